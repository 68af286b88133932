"""Finding clang, compiling kernels (check pass + shared object), and the on-disk cache.

The cache lives in ``$MLX_BRICKS_HOME/emulator`` (default ``~/.cache/mlx_bricks/emulator``);
files are named by the SHA-256 of everything that goes into them (translation unit, shim,
compiler version, flags). Writers build into a private temporary name and ``os.replace`` it, so
concurrent processes never see half-written files.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path

from .source import Generated, TgDecl, cpp_translation_unit

SHIM_DIR = Path(__file__).resolve().parent / "shim"
MIN_CLANG = 15


class EmulatorFault(RuntimeError):
    """A kernel did something a GPU would hide or punish: out-of-bounds access, an output
    element left unwritten, a result that depends on thread order (a race), a barrier reached
    by part of a threadgroup. The message names the kernel and the threads or elements."""


class EmulatorCompileError(EmulatorFault):
    """The kernel does not compile: an MSL error, an address-space mismatch, or an MSL feature
    the emulator does not provide (the message names it)."""


def cache_dir() -> Path:
    home = os.environ.get("MLX_BRICKS_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "mlx_bricks"
    d = base / "emulator"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _clang_version(path: str) -> tuple[int, str] | None:
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except OSError:
        return None
    m = re.search(r"clang version (\d+)", out)
    return (int(m.group(1)), out.splitlines()[0]) if m else None


@lru_cache(maxsize=None)
def find_clang() -> tuple[str | None, str]:
    """(path, version line) of a usable clang++ (>= 15), or (None, reason)."""
    env = os.environ.get("MLX_BRICKS_CLANG")
    if env:
        v = _clang_version(env)
        if v is None:
            return None, f"MLX_BRICKS_CLANG={env!r} is not a working clang++"
        if v[0] < MIN_CLANG:
            return None, f"MLX_BRICKS_CLANG={env!r} is clang {v[0]}; need >= {MIN_CLANG}"
        return env, v[1]
    candidates = ["clang++-19"] + [f"clang++-{n}" for n in range(25, MIN_CLANG - 1, -1) if n != 19]
    candidates.append("clang++")
    for name in candidates:
        path = shutil.which(name)
        if not path:
            continue
        v = _clang_version(path)
        if v and v[0] >= MIN_CLANG:
            return path, v[1]
    return None, (
        "clang++-19 not found (need clang >= 15 for _Float16); install Debian package clang-19 "
        "or set MLX_BRICKS_CLANG"
    )


def _host_flags() -> list[str]:
    flags = []
    try:
        cpu = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpu = ""
    words = set(re.findall(r"\b\w+\b", cpu))
    if {"avx2", "f16c", "fma"} <= words:
        flags += ["-mavx2", "-mf16c", "-mfma"]
    return flags


COMMON_FLAGS = [
    "-std=c++17",
    "-w",
    "-fno-exceptions",
    "-fno-rtti",
    "-fno-math-errno",
    # round every half/bfloat operation to its type, as the GPU does (clang's default on x86
    # keeps intermediates in float)
    "-Xclang",
    "-ffloat16-excess-precision=none",
    "-Xclang",
    "-fbfloat16-excess-precision=none",
]
# -fstack-clash-protection: a huge thread-local array touches the fiber stack's guard page.
CODEGEN_FLAGS = ["-fPIC", "-fvisibility=hidden", "-fstack-clash-protection"]
# -nostdlib: kernels need no C++ runtime; libm symbols resolve in the host process.
LINK_FLAGS = ["-shared", "-nostdlib"]


def _opt_flag() -> str:
    """Optimisation level for kernels: ``MLX_BRICKS_EMULATOR_OPT`` (0-3), default 1."""
    level = os.environ.get("MLX_BRICKS_EMULATOR_OPT", "1").strip()
    if level not in ("0", "1", "2", "3"):
        raise ValueError(f"MLX_BRICKS_EMULATOR_OPT must be 0, 1, 2 or 3, got {level!r}")
    return "-O" + level


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, check=False)


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _shim_text() -> str:
    return "".join(
        (SHIM_DIR / n).read_text() for n in ("metal_shim.h", "emu_abi.h", "emu_runtime.cpp")
    )


_lock = threading.Lock()
_runtime_lib = None


def runtime_library() -> ctypes.CDLL:
    """libemu_runtime.so, built on first use and loaded RTLD_GLOBAL (kernels link to it)."""
    global _runtime_lib
    with _lock:
        if _runtime_lib is not None:
            return _runtime_lib
        clang, version = find_clang()
        if clang is None:
            raise EmulatorCompileError(version)
        flags = ["-std=c++17", "-O2", "-fPIC", "-shared", "-pthread"]
        key = _digest(_shim_text(), version, " ".join(flags), "runtime")
        out = cache_dir() / f"runtime_{key}.so"
        if not out.exists():
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
            os.close(fd)
            r = _run([clang, *flags, "-I", str(SHIM_DIR), str(SHIM_DIR / "emu_runtime.cpp"),
                      "-o", tmp])
            if r.returncode != 0:
                os.unlink(tmp)
                raise EmulatorCompileError(f"emulator runtime does not compile:\n{r.stderr}")
            os.replace(tmp, out)
        _runtime_lib = ctypes.CDLL(str(out), mode=ctypes.RTLD_GLOBAL)
        return _runtime_lib


class CompiledKernel:
    """A loaded kernel shared object: ``entry`` is the address of ``emu_kernel_entry``."""

    def __init__(self, path: Path, tg_decls: list[TgDecl], key: str):
        self.path = path
        self.key = key
        self.tg_decls = tg_decls
        self.lib = ctypes.CDLL(str(path))
        self.entry = ctypes.cast(self.lib.emu_kernel_entry, ctypes.c_void_p).value


def _precompiled_shim(clang: str, version: str, flags: list[str]) -> list[str]:
    """``["-include-pch", path]`` for a precompiled metal_shim.h built with ``flags`` (saves
    about a third of each kernel's compile time), or [] if clang cannot build one."""
    key = _digest(_shim_text(), version, " ".join(flags), "pch")
    if key in _pch_failed:
        return []
    pch = cache_dir() / f"shim_{key}.pch"
    if not pch.exists():
        fd, tmp = tempfile.mkstemp(suffix=".pch", dir=cache_dir())
        os.close(fd)
        r = _run([clang, *flags, "-I", str(SHIM_DIR), "-x", "c++-header",
                  str(SHIM_DIR / "metal_shim.h"), "-o", tmp])
        if r.returncode != 0:
            os.unlink(tmp)
            _pch_failed.add(key)
            return []
        os.replace(tmp, pch)
    return ["-include-pch", str(pch)]


_pch_failed: set[str] = set()
_loaded: dict[str, CompiledKernel] = {}
#: Seconds spent in clang by this process (check pass and compile, in parallel), per kernel.
COMPILE_SECONDS: dict[str, float] = {}


def _format_clang_error(kernel: str, stderr: str, unit: str) -> str:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    undeclared = sorted(set(re.findall(r"use of undeclared identifier '(\w+)'", stderr)))
    unknown = sorted(set(re.findall(r"unknown type name '(\w+)'", stderr)))
    note = ""
    missing = undeclared + unknown
    if missing:
        note = (
            "\n(not an MSL name the emulator provides: "
            + ", ".join(missing)
            + "; see docs/emulator.md for the supported subset)"
        )
    body = "\n".join(lines[:60])
    return f"kernel {kernel!r} does not compile for the emulator ({unit}):\n{body}{note}"


def compile_kernel(gen: Generated, check_address_spaces: bool = True) -> CompiledKernel:
    """Compile (or fetch from the cache) the shared object for a generated kernel.

    Runs the address-space check pass (``-fsyntax-only``) and the real compile in parallel.

    Raises:
        EmulatorCompileError: clang missing, the MLX signature is malformed, an MSL error, or
            an address-space mismatch found by the check pass.
    """
    if gen.malformed:
        raise EmulatorCompileError(
            f"kernel {gen.kernel_name!r}: MLX 0.32 generates a malformed signature for it "
            "(two or more outputs, a <input>_shape/_strides/_ndim parameter and no attribute "
            "referenced in the source); Metal would reject it. Reference an attribute such as "
            "thread_position_in_grid in the source."
        )
    runtime_library()
    clang, version = find_clang()
    run_tu = cpp_translation_unit(gen, check_pass=False)
    check_tu = cpp_translation_unit(gen, check_pass=True) if check_address_spaces else None
    flags = COMMON_FLAGS + CODEGEN_FLAGS + [_opt_flag()] + _host_flags()
    check_flags = COMMON_FLAGS + ["-DEMU_CHECK=1"]
    key = _digest(run_tu.text, check_tu.text if check_tu else "", _shim_text(), version,
                  " ".join(flags))
    if key in _loaded:
        return _loaded[key]
    d = cache_dir()
    so = d / f"k_{key}.so"
    if not so.exists():
        t0 = time.perf_counter()
        run_pch = _precompiled_shim(clang, version, flags)
        check_pch = _precompiled_shim(clang, version, check_flags) if check_tu else []
        with tempfile.TemporaryDirectory(dir=d) as tmpd:
            tmp = Path(tmpd)
            (tmp / "run.cpp").write_text(run_tu.text)
            procs = []
            cmd = [clang, *flags, *LINK_FLAGS, *run_pch, "-I", str(SHIM_DIR), "run.cpp",
                   "-o", "k.so"]
            procs.append(("compile", subprocess.Popen(cmd, cwd=tmp, stdout=subprocess.PIPE,
                                                      stderr=subprocess.PIPE, text=True)))
            if check_tu:
                (tmp / "check.cpp").write_text(check_tu.text)
                cmd = [clang, *check_flags, *check_pch, "-fsyntax-only", "-I", str(SHIM_DIR),
                       "check.cpp"]
                procs.append(("address-space check pass", subprocess.Popen(
                    cmd, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
            results = [(what, p, *p.communicate()) for what, p in procs]
            # Report the check pass first: its errors are the more specific ones.
            for what, p, _, err in sorted(results, key=lambda r: r[0] == "compile"):
                if p.returncode != 0:
                    raise EmulatorCompileError(_format_clang_error(gen.kernel_name, err, what))
            # keep the translation unit next to the object, for debugging
            os.replace(tmp / "run.cpp", d / f"k_{key}.cpp")
            os.replace(tmp / "k.so", so)
        COMPILE_SECONDS[gen.kernel_name] = time.perf_counter() - t0
    ck = CompiledKernel(so, run_tu.tg_decls, key)
    _loaded[key] = ck
    return ck
