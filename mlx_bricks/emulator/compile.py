"""Compiling kernels (one clang run, address spaces included), and the on-disk cache.

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
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path

from mlx_bricks import env

from .bfloat_rules import refused_conversions
from .source import Generated, TgDecl, cpp_translation_unit
from .toolchain import (  # noqa: F401  (find_clang, MIN_CLANG: re-exported)
    MIN_CLANG,
    EmulatorCompileError,
    EmulatorFault,
    clang_or_raise,
    find_clang,
    preprocess,
    run,
)

SHIM_DIR = Path(__file__).resolve().parent / "shim"


def cache_dir() -> Path:
    """``$MLX_BRICKS_HOME/emulator`` (default ``~/.cache/mlx_bricks/emulator``), created if absent."""
    from mlx_bricks.home import home

    d = home() / "emulator"
    d.mkdir(parents=True, exist_ok=True)
    return d


@lru_cache(maxsize=None)
def _host_flags_cached() -> tuple[str, ...]:
    return tuple(_host_flags())


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
# Ranges in diagnostics: compile_kernel reads them (address-space copies) and strips them.
DIAG_FLAGS = ["-fdiagnostics-print-source-range-info", "-ferror-limit=200"]
# -fstack-clash-protection: a huge thread-local array touches the fiber stack's guard page.
CODEGEN_FLAGS = ["-fPIC", "-fvisibility=hidden", "-fstack-clash-protection"]
# -nostdlib: kernels need no C++ runtime; libm symbols resolve in the host process.
LINK_FLAGS = ["-shared", "-nostdlib"]


def _opt_flag() -> str:
    """Optimisation level for kernels: ``MLX_BRICKS_EMULATOR_OPT`` (0-3), default 1."""
    return "-O" + env.get("MLX_BRICKS_EMULATOR_OPT")


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


@lru_cache(maxsize=None)
def _shim_text() -> str:
    return "".join(
        (SHIM_DIR / n).read_text() for n in ("metal_shim.h", "emu_abi.h", "emu_runtime.cpp")
    )


@lru_cache(maxsize=1)
def _driver_text() -> str:
    """This file and bfloat_rules.py: the link and diagnostic flags and the struct-copy patches
    shape each kernel's object, and the bfloat rules decide whether one is built at all, so a
    cached one built by another version of them is not reused."""
    here = Path(__file__).resolve().parent
    return (here / "compile.py").read_text() + (here / "bfloat_rules.py").read_text()


_lock = threading.Lock()
_runtime_lib = None


def runtime_library() -> ctypes.CDLL:
    """libemu_runtime.so, built on first use and loaded RTLD_GLOBAL (kernels link to it)."""
    global _runtime_lib
    with _lock:
        if _runtime_lib is not None:
            return _runtime_lib
        clang, version = clang_or_raise()
        flags = ["-std=c++17", "-O2", "-fPIC", "-shared", "-pthread"]
        key = _digest(_shim_text(), version, " ".join(flags), "runtime")
        out = cache_dir() / f"runtime_{key}.so"
        if not out.exists():
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir())
            os.close(fd)
            r = run([clang, *flags, "-I", str(SHIM_DIR), str(SHIM_DIR / "emu_runtime.cpp"),
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
    # A PCH records the absolute path and the mtime of each header it read: two checkouts
    # sharing one cache must not share a PCH (the TU's own #include of the shim would be a
    # second, redefining copy), and a fresh clone's new mtimes make clang refuse the old one.
    mtimes = [str((SHIM_DIR / n).stat().st_mtime_ns) for n in ("metal_shim.h", "emu_abi.h")]
    key = _digest(_shim_text(), str(SHIM_DIR), *mtimes, version, " ".join(flags), "pch")
    if key in _pch_failed:
        return []
    pch = cache_dir() / f"shim_{key}.pch"
    if not pch.exists():
        fd, tmp = tempfile.mkstemp(suffix=".pch", dir=cache_dir())
        os.close(fd)
        r = run([clang, *flags, "-I", str(SHIM_DIR), "-x", "c++-header",
                  str(SHIM_DIR / "metal_shim.h"), "-o", tmp])
        if r.returncode != 0:
            os.unlink(tmp)
            _pch_failed.add(key)
            return []
        os.replace(tmp, pch)
    return ["-include-pch", str(pch)]


_pch_failed: set[str] = set()
_STALE_PCH = "has been modified since the precompiled header"
_loaded: dict[str, CompiledKernel] = {}
# (MLX's kernel text, flags) -> kernel: repeated launches skip the rewriting and hashing
_by_source: dict[tuple[str, int, tuple[str, ...]], CompiledKernel] = {}
#: Seconds spent in clang by this process, per kernel.
COMPILE_SECONDS: dict[str, float] = {}


_AS_TYPE = re.compile(r"'[^'\n]*\b(?:device|constant|threadgroup)\b[^'\n]*'")


def _format_clang_error(kernel: str, stderr: str) -> str:
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
    if "address space" in stderr or _AS_TYPE.search(stderr):
        note += (
            "\n(Metal's device, constant, threadgroup and thread address spaces are distinct: "
            "a pointer or reference to one does not convert to another)"
        )
    return f"kernel {kernel!r} does not compile for the emulator:\n{body}{note}"


# ---------------------------------------------------------------------------------------------
# Copies of structs between address spaces
#
# MSL copies a class object from or into device/constant/threadgroup memory with its implicit
# copy constructor and assignment (MLX steel's BlockLoader: `*(threadgroup ReadVector*)dst =
# *(const device ReadVector*)src;`). clang's implicit members only take objects in the generic
# address space, so it refuses these. When it does, the operands it names are wrapped in
# ::emu::as_plain(...) (the same object, seen in the default address space) and the kernel is
# compiled again. Only refusals of a class copy are treated so; every other address-space error
# stays an error.

_DIAG = re.compile(r"^(header|source):(\d+):(\d+):((?:\{\d+:\d+-\d+:\d+\})*):? ?(error|note|warning): "
                   r"(.*)$")
_RANGE = re.compile(r"\{(\d+):(\d+)-(\d+):(\d+)\}")
# a quoted object type (not a pointer) in an address space: 'device Pack const'
_AS_OBJECT = re.compile(r"'[^'*\n]*\b(?:device|constant|threadgroup)\b[^'*\n]*'")
_IMPLICIT_AS = re.compile(
    r"candidate (?:constructor|function) \(the implicit (?:copy|move) (?:constructor|assignment "
    r"operator)\) not viable: (?:cannot bind reference in address space|'this' object is in "
    r"address space)"
)
_DIAG_RANGES = re.compile(r"^(\S+?:\d+:\d+):(?:\{[^}\n]*\})+:", re.M)
_MAX_COPY_ROUNDS = 4


def _strip_ranges(stderr: str) -> str:
    """clang's diagnostics without the ``{line:col-line:col}`` range lists."""
    return _DIAG_RANGES.sub(r"\1:", stderr)


def _copy_patches(stderr: str) -> set[tuple[str, int, int, int, int]]:
    """(file, line, col, end line, end col) of each operand to wrap in ``::emu::as_plain``:
    those of errors that refuse to copy a struct out of, or into, an address space."""
    groups: list[list[tuple]] = []
    for line in stderr.splitlines():
        m = _DIAG.match(line)
        if not m:
            continue
        kind = m.group(5)
        entry = (m.group(1), m.group(4), m.group(6))
        if kind == "error":
            groups.append([entry])
        elif kind == "note" and groups:
            groups[-1].append(entry)
    patches = set()
    for (file, ranges, msg), *notes in groups:
        copy = (
            (msg.startswith(("no matching constructor for initialization of",
                             "no viable overloaded '='"))
             and any(_IMPLICIT_AS.search(n[2]) for n in notes))
            # `Pack a[2] = {dev[0], dev[1]}`, `c ? dev[0] : p`
            or (msg.startswith(("no viable conversion from '", "incompatible operand types ("))
                and _AS_OBJECT.search(msg.split("' to '")[0] + "'"))
        )
        if not copy:
            continue
        # operands written in a macro: their ranges are in the note naming the macro
        for nfile, nranges, nmsg in notes:
            if nmsg.startswith("expanded from macro") and nranges:
                file, ranges = nfile, nranges
                break
        for r in _RANGE.finditer(ranges):
            patches.add((file, *map(int, r.groups())))
    return patches


def _apply_copy_patches(text: str, patches) -> str | None:
    """The translation unit with each range wrapped in ``::emu::as_plain(...)``; None if a range
    cannot be placed (the error then stands)."""
    lines = text.encode().split(b"\n")
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln) + 1)
    data = b"\n".join(lines)
    spans = []
    for _file, l0, c0, l1, c1 in patches:
        # range lines are the translation unit's physical lines (not the #line-presumed ones)
        if not (1 <= l0 <= len(lines) and 1 <= l1 <= len(lines)):
            return None
        a = offsets[l0 - 1] + c0 - 1
        b = offsets[l1 - 1] + c1 - 1
        if not 0 <= a < b <= len(data):
            return None
        seg = data[a:b]
        if seg.startswith(b"{") and seg.endswith(b"}"):  # `Pack p{dev[0]}`: the element
            a, b = a + 1, b - 1
        spans.append((a, b))
    spans.sort()
    for (a0, b0), (a1, b1) in zip(spans, spans[1:]):
        if a1 < b0 and not (a0 <= a1 and b1 <= b0):
            return None  # overlapping, not nested
    # insert from the back so earlier offsets stay valid; nested spans: outer opens first
    inserts = []
    for a, b in spans:
        inserts.append((a, 1, -b, b"::emu::as_plain("))
        inserts.append((b, 0, -a, b")"))
    for pos, _, _, piece in sorted(inserts, key=lambda t: (t[0], t[1], t[2]), reverse=True):
        data = data[:pos] + piece + data[pos:]
    return data.decode()


def build(kernel: str, text: str, cmd: list[str], outputs: list[str], tmp: Path,
          pch: list[str] = ()) -> tuple[str, list[str]]:
    """Run ``cmd + ["run.cpp"] + outputs`` in ``tmp`` on the translation unit ``text``, wrapping
    the operands of struct copies between address spaces as clang refuses them (a round each,
    at most ``_MAX_COPY_ROUNDS``) and dropping a stale ``pch`` once. Returns the text that
    compiled and the command without its outputs (stale PCH dropped).

    Raises:
        EmulatorCompileError: clang's errors, positions in the kernel's own text.
    """
    first = text
    pch = list(pch)
    for _ in range(_MAX_COPY_ROUNDS + bool(pch)):  # + 1: a stale-PCH retry
        (tmp / "run.cpp").write_text(text)
        r = run([*cmd, "run.cpp", *outputs], cwd=tmp)
        if r.returncode == 0:
            return text, cmd
        if pch and _STALE_PCH in r.stderr:
            # a header touched after the key was taken: build this one without the PCH
            cmd = [c for c in cmd if c not in pch]
            pch = []
            continue
        patches = _copy_patches(r.stderr)
        patched = _apply_copy_patches(text, patches) if patches else None
        if patched is None or patched == text:
            break
        text = patched
    msg = _format_clang_error(kernel, _strip_ranges(r.stderr))
    if text != first:
        msg += ("\n(::emu::as_plain(...): the emulator's wrapping of struct copies between "
                "address spaces; see docs/emulator.md)")
    raise EmulatorCompileError(msg)


#: Buffer arguments a Metal kernel may have: [[buffer(0)]] .. [[buffer(30)]].
MAX_BUFFERS = 31
def _check_buffers(gen: Generated) -> None:
    n = max((p.buffer for p in gen.params), default=-1) + 1
    if n > MAX_BUFFERS:
        names = ", ".join(p.name for p in gen.params if p.buffer >= MAX_BUFFERS)
        raise EmulatorCompileError(
            f"kernel {gen.kernel_name!r} needs {n} buffers; Metal allows {MAX_BUFFERS} "
            f"([[buffer(0)]] .. [[buffer({MAX_BUFFERS - 1})]]), MLX's <input>_shape/_strides/_ndim "
            f"parameters included; past the limit: {names}"
        )


def _check_bfloat_rules(clang: str, cmd_flags: list[str], gen: Generated, text: str,
                        tmp: Path) -> None:
    """Metal's bfloat conversion rules (``bfloat_rules``): clang's __bf16 converts implicitly
    where Metal's bfloat does not. One front-end run with an AST dump, only for kernels that
    mention bfloat."""
    if "bfloat" not in text:
        return
    (tmp / "ast.cpp").write_text(text)
    r = run([clang, *cmd_flags, "-fsyntax-only", "-Xclang", "-ast-dump", "-fno-color-diagnostics",
             "ast.cpp"], cwd=tmp)
    if r.returncode != 0:  # it compiled a moment ago: only a broken toolchain gets here
        raise EmulatorCompileError(_format_clang_error(gen.kernel_name, r.stderr))
    refused = refused_conversions(r.stdout)
    if refused:
        shown = "\n".join(f"  {c}" for c in refused[:20])
        more = f"\n  ... and {len(refused) - 20} more" if len(refused) > 20 else ""
        raise EmulatorCompileError(
            f"kernel {gen.kernel_name!r} does not compile on Metal: implicit bfloat "
            f"conversions Apple's compiler refuses (MSL 3.1: bfloat converts implicitly only to "
            f"float; float, half and int never implicitly to bfloat):\n{shown}{more}\n"
            "(write bfloat(x) or static_cast<bfloat>(x), float(b) to mix a bfloat with an int; "
            "see docs/emulator.md, 'As strict as Apple's compiler')"
        )


def compile_kernel(gen: Generated, check_address_spaces: bool = True) -> CompiledKernel:
    """Compile (or fetch from the cache) the shared object for a generated kernel.

    One clang run: ``device``, ``constant`` and ``threadgroup`` are distinct clang address
    spaces (see metal_shim.h), so address-space mistakes are compile errors as on Metal.
    ``check_address_spaces=False`` compiles them away (EMU_FLAT): mismatches are then accepted,
    and overloads or specialisations that differ only in the address space collide. A kernel
    that mentions bfloat gets a second, front-end-only run whose AST is checked against Metal's
    bfloat conversion rules (``bfloat_rules``).

    Raises:
        EmulatorCompileError: clang missing, the MLX signature is malformed, more than
            ``MAX_BUFFERS`` buffers, an MSL error, an address-space mismatch, or an implicit
            conversion to (or from) bfloat that Metal refuses.
    """
    if gen.malformed:
        raise EmulatorCompileError(
            f"kernel {gen.kernel_name!r}: MLX 0.32 generates a malformed signature for it "
            "(two or more outputs, a <input>_shape/_strides/_ndim parameter and no attribute "
            "referenced in the source); Metal would reject it. Reference an attribute such as "
            "thread_position_in_grid in the source."
        )
    _check_buffers(gen)
    flags = COMMON_FLAGS + CODEGEN_FLAGS + [_opt_flag(), *_host_flags_cached()]
    if not check_address_spaces:
        flags.append("-DEMU_FLAT=1")
    known = _by_source.get((gen.source, len(gen.header), tuple(flags)))
    if known is not None:  # launched before in this process: no rewriting, no hashing
        return known
    runtime_library()
    clang, version = find_clang()
    tu = cpp_translation_unit(gen, preprocess)
    key = _digest(tu.text, _shim_text(), version, " ".join(flags), _driver_text())
    if key in _loaded:
        _by_source[(gen.source, len(gen.header), tuple(flags))] = _loaded[key]
        return _loaded[key]
    d = cache_dir()
    so = d / f"k_{key}.so"
    if not so.exists():
        t0 = time.perf_counter()
        pch = _precompiled_shim(clang, version, flags)
        with tempfile.TemporaryDirectory(dir=d) as tmpd:
            tmp = Path(tmpd)
            cmd = [clang, *flags, *pch, *DIAG_FLAGS, "-I", str(SHIM_DIR)]
            text, cmd = build(gen.kernel_name, tu.text, cmd, LINK_FLAGS + ["-o", "k.so"], tmp,
                              pch)
            _check_bfloat_rules(clang, cmd, gen, text, tmp)
            # keep the translation unit next to the object, for debugging
            os.replace(tmp / "run.cpp", d / f"k_{key}.cpp")
            os.replace(tmp / "k.so", so)
        COMPILE_SECONDS[gen.kernel_name] = time.perf_counter() - t0
    ck = CompiledKernel(so, tu.tg_decls, key)
    _loaded[key] = ck
    _by_source[(gen.source, len(gen.header), tuple(flags))] = ck
    return ck
