"""CUDA kernels built once per machine: a persistent NVRTC build cache behind ``kernels.launch``.

``mx.fast.cuda_kernel`` compiles its source with NVRTC in every process (MLX 0.32's
``CustomKernel::eval_gpu`` asks ``get_jit_module(..., use_disk_cache=false)``), which cost a
fresh ``mlx_lm.generate --use-bricks`` about 9 s of rebuilding on an H100. :class:`CudaKernel`
(what ``kernels.get_kernel`` gives on ``cuda``) compiles each CUDA twin variant once per machine
with MLX's own compiler and options (``cuda.toolchain``) and runs it, in later processes too,
one of two ways (``cuda.source`` writes both units):

* ``mlx`` (the default, :func:`mode`): the exact source ``cuda_kernel`` builds
  (``source.JitUnit``) is put where MLX's JIT looks before compiling (MLX 0.32's ``JitModule``
  reads ``<MLX_PTX_CACHE_DIR or /tmp/mlx/<version>/ptx>/<module>.ptx`` and ``.txt`` for every
  module, custom kernels included, though it writes none for them); the ``cuda_kernel`` object
  then loads it instead of compiling. The module name is ``<kernel name>_<hex std::hash of the
  source>`` (``source.std_hash``: libstdc++'s, which MLX's Linux wheels use); if it ever
  differs, MLX does not find the file and compiles as before. Bodies that read the strides of
  views always go this way.
* ``precompiled``: an ``extern "C"`` unit (``source.Unit``) run through
  ``mx.fast.precompiled_cuda_kernel`` (it copies and hashes the cubin at every launch).

Entries are stored under ``<mlx-bricks home>/cuda/<toolchain>/<kernel>/`` (toolchain: MLX
version, NVRTC version, architecture), named by the template values and a SHA-256 of the whole
unit, the NVRTC options and the in-memory header, with a JSON note (SHA-256 of the cubin,
compile seconds) written last, so a half-written entry is never read.

Any failure (no GPU, no ``libnvrtc``, a compile error, an unreadable entry) falls back to
``mx.fast.cuda_kernel`` as before, with a one-line note on stderr, once per cause
(``MLX_BRICKS_CUDA_CACHE=0``: the cache off). A cubin that fails to load surfaces when MLX
evaluates the launch, where the dispatch guard (``runtime/guard.py``) catches it.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from functools import lru_cache
from pathlib import Path

from mlx_bricks import env
from mlx_bricks import home as _home
from mlx_bricks.cuda.source import (
    DEVICE_HEADER,
    JitUnit,
    Unit,
    _dtype_name,
    jit_unit,
    reads_view_strides,
    template_tag,
    translation_unit,
)
from mlx_bricks.cuda.toolchain import (
    CompileError,
    Nvrtc,
    Toolchain,
    Unavailable,
    cuda_capability,
    make_toolchain,
)

#: Environment switch: ``0`` / ``off`` / ``false`` / ``no`` turn the build cache off (:func:`mode`).
ENV_VAR = "MLX_BRICKS_CUDA_CACHE"
#: Bumped when the unit's layout or the entry format changes (old entries are then not read).
FORMAT = 1

#: Seconds each kernel variant's first call took to build in this process, by
#: ``(kernel, template tag)``: the NVRTC compile on a miss, the read of the entry on a hit.
BUILD_SECONDS: dict[tuple[str, str], float] = {}
#: How each cached variant was obtained in this process: ``"compiled"`` or ``"loaded"``, by
#: ``(kernel, template tag)``.
BUILD_SOURCES: dict[tuple[str, str], str] = {}
#: Which way each variant runs in this process, by ``(kernel, template tag)``:
#: ``"precompiled"``, ``"mlx-cache"`` or ``"cuda_kernel"`` (:class:`CudaKernel`).
BUILD_ROUTES: dict[tuple[str, str], str] = {}

_NOTED: set[str] = set()


def mode() -> str:
    """``$MLX_BRICKS_CUDA_CACHE`` (``mlx_bricks.env``), read at each call: ``"off"`` (``0`` /
    ``off`` / ``false`` / ``no``: ``mx.fast.cuda_kernel`` as before), ``"precompiled"``
    (``precompiled_cuda_kernel`` where it can run the kernel: it copies and hashes the cubin at
    every launch, unmeasured) or ``"mlx"`` (the default; ``mlx``, ``1``, ``on``, ``true``,
    ``yes``: every kernel through MLX's JIT disk cache, as the view kernels go: ``cuda_kernel``'s
    own launch path, no per-launch cost of ours).

    Raises:
        env.EnvError: another value.
    """
    global _MODE
    raw, memo = os.environ.get(ENV_VAR), _MODE  # (one read of the pair: threads rebind it)
    if memo is not None and memo[0] == raw:  # parsed once per value (read per launch)
        return memo[1]
    value = env.get(ENV_VAR)
    _MODE = (raw, value)
    return value


#: ``(raw value, parsed)`` of the last :func:`mode` read.
_MODE: tuple | None = None


def enabled() -> bool:
    """Whether the build cache is on (:func:`mode` is not ``"off"``)."""
    return mode() != "off"


def note(key: str, message: str) -> None:
    """Print ``message`` on stderr once per ``key`` in this process."""
    if key not in _NOTED:
        _NOTED.add(key)
        print(f"mlx-bricks: {message}", file=sys.stderr)


def _mx():
    import mlx.core as mx

    return mx


@lru_cache(maxsize=1)
def toolchain() -> Toolchain:
    """This process's toolchain (the default CUDA device).

    Raises:
        Unavailable: no CUDA device or no libnvrtc.
    """
    cc = cuda_capability()
    if cc is None:
        raise Unavailable("no CUDA device")
    return make_toolchain(cc)


# ---------------------------------------------------------------------------------------------
# The disk cache

def cache_root(override=None) -> Path:
    """``<mlx-bricks home>/cuda``: every toolchain's entries."""
    return _home.home(override) / "cuda"


def entry_key(unit, tc: Toolchain) -> str:
    """SHA-256 (hex) of everything the cubin depends on: the unit (its kind and source), the
    in-memory device header, the NVRTC options and version, MLX's version and the entry
    format."""
    h = hashlib.sha256()
    for part in (f"format {FORMAT}", type(unit).__name__, unit.source, DEVICE_HEADER,
                 "\0".join(tc.options), f"nvrtc {tc.nvrtc.version}", f"mlx {tc.mlx_version}"):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def entry_paths(kernel: str, tag: str, key: str, tc: Toolchain, root=None) -> tuple[Path, Path]:
    """``(cubin, note)`` paths of one entry."""
    d = cache_root(root) / tc.tag / kernel
    stem = f"{tag.lstrip('_') or 'none'}-{key[:16]}"
    return d / f"{stem}.cubin", d / f"{stem}.json"


def read_entry(cubin_path: Path, note_path: Path) -> tuple[bytes, dict] | None:
    """``(cubin, note)`` of a complete, intact entry, else None."""
    try:
        meta = json.loads(note_path.read_text())
        data = cubin_path.read_bytes()
    except (OSError, ValueError):
        return None
    if meta.get("sha256") != hashlib.sha256(data).hexdigest() or not data.startswith(b"\x7fELF"):
        return None
    return data, meta


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_entry(cubin_path: Path, note_path: Path, cubin: bytes, seconds: float,
                unit, extra: dict | None = None) -> dict:
    """Store an entry: the cubin, then its note (so a reader never sees half of it); the
    note."""
    cubin_path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(cubin_path, cubin)
    meta = {"sha256": hashlib.sha256(cubin).hexdigest(), "compile_seconds": round(seconds, 4),
            "func_name": unit.func_name, "format": FORMAT, **(extra or {})}
    _write_atomic(note_path, json.dumps(meta).encode())
    return meta


def load_or_build(kernel: str, tag: str, unit, tc: Toolchain, root=None
                  ) -> tuple[bytes, float, str, dict]:
    """``(cubin, seconds, how, note)`` of ``unit`` (a :class:`Unit` or :class:`JitUnit`): read
    from the cache (``how`` ``"loaded"``) or compiled now and stored (``"compiled"``);
    ``seconds``: wall time of this step; ``note``: the entry's JSON fields.

    Raises:
        CompileError: NVRTC failed. A failed write is noted and the cubin still returned.
    """
    t0 = time.perf_counter()
    key = entry_key(unit, tc)
    cubin_path, note_path = entry_paths(kernel, tag, key, tc, root)
    found = read_entry(cubin_path, note_path)
    if found is not None:
        return found[0], time.perf_counter() - t0, "loaded", found[1]
    data, extra = unit.build(tc)
    seconds = time.perf_counter() - t0
    meta = {"func_name": unit.func_name, **extra}
    try:
        meta = write_entry(cubin_path, note_path, data, seconds, unit, extra)
    except OSError as e:
        note(f"write:{cubin_path.parent}", f"CUDA build cache not written ({e}); "
             "kernels are rebuilt in the next process")
    return data, seconds, "compiled", meta




def mlx_ptx_cache_dir() -> Path:
    """MLX's JIT disk cache (``ptx_cache_dir`` in ``jit_module.cpp``): ``$MLX_PTX_CACHE_DIR``,
    else ``<temp dir>/mlx/<MLX version>/ptx`` (temp dir as ``std::filesystem::
    temp_directory_path``: ``$TMPDIR``, ``$TMP``, ``$TEMP``, ``$TEMPDIR``, else ``/tmp``)."""
    import mlx.core as mx

    env = os.environ.get("MLX_PTX_CACHE_DIR")
    if env:
        return Path(env)
    tmp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR")
                if os.environ.get(v)), "/tmp")
    return Path(tmp) / "mlx" / mx.__version__ / "ptx"


def mlx_ptx_path(cache_dir: Path, module_name: str) -> Path:
    """MLX's file of ``module_name`` (``get_ptx_path``: names over 245 characters are cut into
    directories of 245)."""
    path, rest = Path(cache_dir), module_name
    while len(rest) > 245:
        path, rest = path / rest[:245], rest[245:]
    return path / f"{rest}.ptx"




def seed_mlx_cache(unit: JitUnit, cubin: bytes, lowered: str, cache_dir: Path | None = None
                   ) -> Path:
    """Put ``cubin`` where MLX's JIT looks for ``unit``'s module (the name file first, so MLX
    never reads a cubin without it); returns the ``.ptx`` path. Nothing is written when the
    same cubin is there already.

    Raises:
        OSError: the directory is not writable.
    """
    ptx = mlx_ptx_path(cache_dir or mlx_ptx_cache_dir(), unit.module_name)
    try:
        if ptx.read_bytes() == cubin:
            return ptx
    except OSError:
        pass
    ptx.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(ptx.with_suffix(".txt"), f"{unit.expression}\t{lowered}\n".encode())
    _write_atomic(ptx, cubin)
    return ptx


# ---------------------------------------------------------------------------------------------
# Questions for the tuner

def _match(kernel: str, template) -> list[tuple[str, str]]:
    tag = None if template is None else template_tag(template)
    return [k for k in BUILD_SECONDS if k[0] == kernel and (tag is None or k[1] == tag)]


def build_cost(kernel: str, template=None) -> float | None:
    """Seconds this process spent building kernel ``kernel`` (a registered name) at its first
    calls: the variant of ``template`` (``[(name, value), ...]`` as given to ``launch``), or
    every variant built so far summed; None when none was built here through the cache (MLX's
    own ``cuda_kernel`` compiles lazily, at evaluation, where it is not measured)."""
    keys = _match(kernel, template)
    return sum(BUILD_SECONDS[k] for k in keys) if keys else None


def is_built(kernel: str, template=None, root=None) -> bool:
    """Whether a variant of kernel ``kernel`` (of ``template``, if given) is on disk for this
    process's toolchain, so a new process loads it instead of compiling. False without a CUDA
    device or libnvrtc, or with the cache off."""
    if not enabled():
        return False
    try:
        tc = toolchain()
    except Unavailable:
        return False
    d = cache_root(root) / tc.tag / kernel
    stem = None if template is None else template_tag(template).lstrip("_") or "none"
    pattern = "*.json" if stem is None else f"{stem}-*.json"
    return any(p.with_suffix(".cubin").is_file() for p in d.glob(pattern))


# ---------------------------------------------------------------------------------------------
# The kernel object behind kernels.launch

class CudaKernel:
    """The ``cuda`` kernel object of one registered spec and dynamic shared-memory size, called
    like an ``mx.fast.cuda_kernel`` object. Each variant (template values, input dtypes and
    ndims, output dtypes) is compiled once per machine (:func:`load_or_build`) and then

    * ``precompiled``: run through ``mx.fast.precompiled_cuda_kernel`` (:class:`Unit`), or,
      for a body that reads the strides of views,
    * ``mlx-cache``: put where MLX's JIT looks for it (:class:`JitUnit`,
      :func:`seed_mlx_cache`) and run by the ``mx.fast.cuda_kernel`` object, which then loads it
      instead of compiling;

    or, when neither can serve, run by the ``mx.fast.cuda_kernel`` object as before.

    Args:
        kernel: the registered name (``mlx_bricks.kernels``).
        kname: the unique kernel name (``kernels.kernel_source``).
        header, body: the twin's sources.
        input_names, output_names, ensure_row_contiguous: as in ``cuda_kernel``.
        shared_memory: dynamic shared memory of every launch, bytes (part of the kernel's name:
            MLX sets a function's shared-memory limit once, at its first launch).
        stock_name, stock_body: ``name`` and ``source`` of the ``cuda_kernel`` object.
        stock: zero-argument factory of that ``mx.fast.cuda_kernel`` object.
    """

    def __init__(self, kernel: str, kname: str, header: str, body: str, input_names,
                 output_names, ensure_row_contiguous: bool, shared_memory: int,
                 stock_name: str, stock_body: str, stock):
        self.kernel, self.kname, self.header, self.body = kernel, kname, header, body
        self.input_names, self.output_names = tuple(input_names), tuple(output_names)
        self.ensure_row_contiguous = ensure_row_contiguous
        self.shared_memory = shared_memory
        self.stock_name, self.stock_body = stock_name, stock_body
        self._stock_factory, self._stock = stock, None
        #: variant key -> (Unit, cubin), or None (run by the cuda_kernel object)
        self.variants: dict = {}

    def stock(self):
        """The ``mx.fast.cuda_kernel`` object (built once)."""
        if self._stock is None:
            self._stock = self._stock_factory()
        return self._stock

    def unit(self, template, inputs, output_dtypes, route: str = "precompiled"):
        """The unit of one variant: a :class:`JitUnit` when the body reads the strides of
        views or ``route`` is ``"mlx"``, else a :class:`Unit`; ``inputs``:
        ``[(dtype, ndim), ...]``.

        Raises:
            ValueError: see :func:`translation_unit`.
        """
        ins = [(n, d, nd) for n, (d, nd) in zip(self.input_names, inputs)]
        if route == "mlx" or reads_view_strides(self.input_names, self.body,
                                                self.ensure_row_contiguous):
            return jit_unit(self.stock_name, self.header, self.stock_body, ins,
                            self.output_names, output_dtypes, template)
        smem = f"_smem{self.shared_memory}" if self.shared_memory else ""
        return translation_unit(f"{self.kname}{template_tag(template)}{smem}", self.header,
                                self.body, ins, self.output_names, output_dtypes, template,
                                self.ensure_row_contiguous)

    def _variant(self, template, arrays, output_dtypes, route):
        tag = template_tag(template)
        rec = (self.kernel, tag)
        BUILD_ROUTES[rec] = "cuda_kernel"
        try:
            tc = toolchain()
        except Unavailable as e:
            note("toolchain", f"CUDA build cache off: {e}; kernels are built by "
                 "mx.fast.cuda_kernel in each process")
            return None
        try:
            unit = self.unit(template, [(a.dtype, a.ndim) for a in arrays], output_dtypes,
                             route)
            if isinstance(unit, Unit) and not hasattr(_mx().fast, "precompiled_cuda_kernel"):
                note("precompiled", "this MLX has no mx.fast.precompiled_cuda_kernel; kernels "
                     "are built by mx.fast.cuda_kernel in each process")
                return None
            cubin, seconds, how, meta = load_or_build(self.kernel, tag, unit, tc)
            if isinstance(unit, JitUnit):
                seed_mlx_cache(unit, cubin, meta["lowered"])
        except (ValueError, KeyError, CompileError, OSError) as e:
            text = str(e).strip()
            first = text.splitlines()[0] if text else type(e).__name__
            note(f"build:{self.kernel}{tag}", f"CUDA kernel {self.kernel}{tag} not cached "
                 f"({first}); built by mx.fast.cuda_kernel")
            return None
        BUILD_SECONDS[rec] = BUILD_SECONDS.get(rec, 0.0) + seconds
        BUILD_SOURCES[rec] = how
        if isinstance(unit, JitUnit):
            BUILD_ROUTES[rec] = "mlx-cache"
            return None
        BUILD_ROUTES[rec] = "precompiled"
        return unit, cubin

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=(), init_value=None, verbose=False, stream=None):
        kw = dict(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                  grid=grid, threadgroup=threadgroup, template=template,
                  init_value=init_value, verbose=verbose, stream=stream)
        route = mode()
        if route == "off":
            return self.stock()(**kw)
        import mlx.core as mx

        arrays = [a if isinstance(a, mx.array) else mx.array(a) for a in inputs]
        key = (route, tuple(template), tuple((a.dtype, a.ndim) for a in arrays),
               tuple(output_dtypes))
        try:  # (ints, bools and dtypes: hashable; anything else by its text)
            found = self.variants.get(key, _MISSING)
        except TypeError:
            key = (route, tuple((n, v if isinstance(v, (bool, int)) else _dtype_name(v))
                                for n, v in template), key[2], key[3])
            found = self.variants.get(key, _MISSING)
        if found is _MISSING:
            found = self.variants[key] = self._variant(template, arrays, output_dtypes, route)
        if found is None:
            return self.stock()(**kw)
        unit, cubin = found
        return mx.fast.precompiled_cuda_kernel(
            name=unit.func_name, compiled_source=cubin, inputs=arrays,
            output_shapes=[tuple(s) for s in output_shapes], output_dtypes=list(output_dtypes),
            scalars=unit.scalars([a.shape for a in arrays]), grid=tuple(grid),
            threadgroup=tuple(threadgroup), shared_memory=self.shared_memory,
            init_value=init_value, ensure_row_contiguous=self.ensure_row_contiguous,
            stream=stream)


#: A variant :class:`CudaKernel` has not looked up yet.
_MISSING = object()


# ---------------------------------------------------------------------------------------------
# Building ahead, in parallel

def _build_entry(args) -> tuple[str, str, float, str]:
    """Worker of :func:`prebuild` (a fresh process: NVRTC only, no CUDA context)."""
    kernel, tag, unit, nvrtc_path, cc, mlx_version, options, root = args
    tc = Toolchain(Nvrtc(nvrtc_path), cc, mlx_version, options)
    try:
        _, seconds, how, _ = load_or_build(kernel, tag, unit, tc, root)
    except CompileError as e:
        return kernel, tag, 0.0, f"error: {str(e).strip().splitlines()[0]}"
    return kernel, tag, seconds, how


def prebuild(kernel_launches, workers: int | None = None, root=None
             ) -> list[tuple[str, str, float, str]]:
    """Compile the variants of ``kernel_launches`` that are not on disk yet, ``workers`` at a
    time in separate processes (NVRTC is CPU-bound); later launches then load them
    (``kernels.prebuild`` gives the pairs).

    Args:
        kernel_launches: ``[(CudaKernel, launch), ...]``; a launch has ``inputs``
            (``[(dtype, ndim), ...]``), ``output_dtypes`` and ``template``
            (``mlx_bricks.cudacheck.Launch``).
        workers: processes (default: one per CPU).
        root: the home directory (default ``mlx_bricks.home``).

    Returns:
        ``(kernel, template tag, seconds, how)`` per distinct variant, ``how`` ``"loaded"`` (on
        disk already), ``"compiled"`` or ``"error: ..."``.

    Raises:
        Unavailable: no CUDA device or libnvrtc.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    tc = toolchain()
    jobs, seen = [], set()
    for obj, rec in kernel_launches:
        unit = obj.unit(rec.template, rec.inputs, rec.output_dtypes, mode())
        key = entry_key(unit, tc)
        if key in seen:
            continue
        seen.add(key)
        jobs.append((obj.kernel, template_tag(rec.template), unit, tc.nvrtc.path, tc.cc,
                     tc.mlx_version, tc.options, root))
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1, mp_context=ctx) as ex:
        return list(ex.map(_build_entry, jobs))
