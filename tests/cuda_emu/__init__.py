"""Run the CUDA twins on the CPU through ``warp_emu.h`` (tests only).

:func:`run_kernel` (and :func:`emulated_launches`, which routes an op's launches to it) runs any
registered twin, the GEMM family's mma.sync path and the dequantize brick included, with MLX's
generated parameters and row-contiguous inputs. :func:`run_attention` builds a host program
from the exact kernel body and headers the cuda backend gives ``mx.fast.cuda_kernel``
(``kernels.kernel_source``), wrapped the way MLX wraps it (template constants inside the
function, ``<name>_shape`` / ``_strides`` parameters), compiles it with the host C++ compiler
against the CUDA toolkit's headers (types only), and runs one launch with the geometry
``launch_attention_cuda`` would use. Inputs are numpy buffers with
explicit element offsets and strides, so transposed views, cache slices, non-unit head_dim
strides and misaligned rows reach the kernel exactly as MLX would pass them.

``MLX_BRICKS_CUDA_EMU_SANITIZE=1`` builds the host programs with AddressSanitizer and
UndefinedBehaviorSanitizer (a separate cache entry), so an out-of-bounds global or heap access
of a twin (an output row past its end, a scale read past its group) fails the run as the MSL
emulator's guarded buffers do; shared memory keeps its 16 bytes of slack.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mlx_bricks import cudacheck, kernels
from mlx_bricks.cuda.source import template_lines

HERE = Path(__file__).resolve().parent
CUDA_SRC = Path(kernels.__file__).resolve().parent / "cuda_src"
_CACHE = Path(tempfile.gettempdir()) / "mlx_bricks_cuda_emu"

_CTYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "int8": "int8_t"}


def _sanitize() -> bool:
    """Whether the host programs run under ASan + UBSan (``MLX_BRICKS_CUDA_EMU_SANITIZE``)."""
    return os.environ.get("MLX_BRICKS_CUDA_EMU_SANITIZE", "") not in ("", "0")


_SANITIZE_FLAGS = ["-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def _run(cmd, timeout: int):
    """Run a host program; under the sanitizers without leak checks (the programs never free
    their input buffers)."""
    env = dict(os.environ, ASAN_OPTIONS="detect_leaks=0") if _sanitize() else None
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def toolchain() -> tuple[str, str] | None:
    """(host C++ compiler, CUDA include dir) or None when either is missing."""
    cxx = shutil.which("g++") or shutil.which("clang++")
    nvcc = cudacheck.find_nvcc()
    if cxx is None or nvcc is None:
        return None
    roots = [Path(nvcc).resolve().parent.parent, *sorted(Path("/usr/local").glob("cuda*"))]
    for root in roots:
        if (root / "include" / "cuda_fp16.h").is_file():
            return cxx, str(root / "include")
    return None


@dataclass
class Tensor:
    """A strided view into a flat numpy buffer: ``dtype`` one of _CTYPE's keys, ``data`` raw
    bits (uint16 for 16-bit floats), ``offset``/``strides`` in elements."""

    dtype: str
    data: np.ndarray
    shape: tuple
    strides: tuple
    offset: int = 0


#: The strided inputs of each attention kernel: (name, C type or "T" / "KT").
_ATTN_STRIDED = {
    "flash_attention": (("q", "T"), ("k", "KT"), ("v", "KT"), ("k_scale", "__half"),
                        ("v_scale", "__half")),
    "flash_attention_fa": (("q", "T"), ("k", "T"), ("v", "T")),
}
_MAIN_ARGS = {"q": "qb.data() + qo, qs, qst", "k": "kb.data() + ko, ks, kst",
              "v": "vb.data() + vo, vs, vst", "k_scale": "ksb.data() + kso, kss, ksst",
              "v_scale": "vsb.data() + vso, vss, vsst"}


def _source(template, kernel: str = "flash_attention") -> str:
    _, header, body = kernels.kernel_source(kernel, "cuda")
    marker = "extern __shared__ __align__(16) unsigned char smem[];"
    assert marker in body, "the attention body must declare its dynamic shared memory as expected"
    body = body.replace(marker, "unsigned char* smem = emu::blk->smem;")
    tdict = dict(template)
    T = _CTYPE[tdict["T"]]
    KT = "int8_t" if tdict.get("KV_Q8") else T
    consts = [line.rstrip("\n") for line in template_lines(template, lambda d: _CTYPE[d])]
    params = []
    for name, ct in _ATTN_STRIDED[kernel]:
        ct = {"T": T, "KT": KT}.get(ct, ct)
        params += [f"const {ct}* {name}", f"const Shape {name}_shape",
                   f"const Strides {name}_strides"]
    params += ["const float* fparams", "const int32_t* iparams", "const int32_t* kv_start",
               "const Strides kv_start_strides", "const float* sinks",
               "const Strides sinks_strides", f"{T}* out"]
    call = ", ".join([_MAIN_ARGS[n] for n, _ in _ATTN_STRIDED[kernel]] +
                     ["prm, iprm, startb.data(), startst, sinkb.data(), sinkst, out"])
    return "\n".join([
        '#include "warp_emu.h"',
        header,
        "using Shape = std::array<int32_t, 10>;",
        "using Strides = std::array<int64_t, 10>;",
        f"static void kernel_fn({', '.join(params)}) {{",
        *consts,
        body,
        "}",
        _MAIN.replace("@T@", T).replace("@KT@", KT).replace("@CALL@", call),
    ])


_MAIN = r"""
template <typename E>
static std::vector<E> read_buf(FILE* f, int64_t n) {
  std::vector<E> v(size_t(n) + 1);
  if (n && std::fread(v.data(), sizeof(E), size_t(n), f) != size_t(n)) std::abort();
  return v;
}
static void read_geom(FILE* f, Shape& s, Strides& st, int64_t& off, int64_t& n) {
  s.fill(0); st.fill(0);
  int64_t h[10];
  if (std::fread(h, 8, 10, f) != 10) std::abort();
  for (int i = 0; i < 4; ++i) { s[i] = int32_t(h[i]); st[i] = h[4 + i]; }
  off = h[8]; n = h[9];
}
int main(int argc, char** argv) {
  FILE* f = std::fopen(argv[1], "rb");
  Shape qs, ks, vs, kss, vss; Strides qst, kst, vst, ksst, vsst;
  int64_t qo, qn, ko, kn, vo, vn, kso, ksn, vso, vsn;
  read_geom(f, qs, qst, qo, qn); auto qb = read_buf<@T@>(f, qn);
  read_geom(f, ks, kst, ko, kn); auto kb = read_buf<@KT@>(f, kn);
  read_geom(f, vs, vst, vo, vn); auto vb = read_buf<@KT@>(f, vn);
  read_geom(f, kss, ksst, kso, ksn); auto ksb = read_buf<__half>(f, ksn);
  read_geom(f, vss, vsst, vso, vsn); auto vsb = read_buf<__half>(f, vsn);
  float prm[3]; if (std::fread(prm, 4, 3, f) != 3) std::abort();
  int32_t iprm[1]; if (std::fread(iprm, 4, 1, f) != 1) std::abort();
  int64_t nstart; if (std::fread(&nstart, 8, 1, f) != 1) std::abort();
  auto startb = read_buf<int32_t>(f, nstart);
  Strides startst; startst.fill(0); startst[0] = 1;
  int64_t nsink; if (std::fread(&nsink, 8, 1, f) != 1) std::abort();
  auto sinkb = read_buf<float>(f, nsink);
  Strides sinkst; sinkst.fill(0); sinkst[0] = 1;
  int64_t g[6]; if (std::fread(g, 8, 6, f) != 6) std::abort();
  std::fclose(f);
  const int64_t nout = g[5];
  std::vector<unsigned char> ob(size_t(nout) * sizeof(@T@), 0xFF);  // poison: NaN bits
  @T@* out = reinterpret_cast<@T@*>(ob.data());
  emu::launch(emu::Dim3{unsigned(g[0]), unsigned(g[1]), unsigned(g[2])}, int(g[3]),
              uint32_t(g[4]), 4, 64, [&] {
    kernel_fn(@CALL@);
  });
  FILE* o = std::fopen(argv[2], "wb");
  std::fwrite(ob.data(), 1, ob.size(), o);
  std::fclose(o);
  return 0;
}
"""


def build(template, kernel: str = "flash_attention") -> Path:
    """Compile (cached by source hash) the attention host program of ``kernel`` for one
    template; returns its path."""
    return _build_source(_source(template, kernel), "attn")


def _geom(t: Tensor | None) -> bytes:
    if t is None:
        return struct.pack("<10q", 1, 1, 1, 1, 0, 0, 0, 0, 0, 1) + b"\0\0"
    shape = list(t.shape) + [1] * (4 - len(t.shape))
    strides = list(t.strides) + [0] * (4 - len(t.strides))
    return struct.pack("<10q", *shape, *strides, t.offset, t.data.size) + t.data.tobytes()


def run_attention(q: Tensor, k: Tensor, v: Tensor, k_scale: Tensor | None,
                  v_scale: Tensor | None, fparams: np.ndarray, iparams: np.ndarray, template,
                  grid, threads: int, smem: int, out_elems: int,
                  kv_start: np.ndarray | None = None,
                  sinks: np.ndarray | None = None, kernel: str = "flash_attention") -> np.ndarray:
    """Run one launch of ``kernel`` (``flash_attention``, or ``flash_attention_fa``, which has
    no Q8_0 scales: pass None for them); returns the raw output buffer (uint16 bits or
    float32). ``kv_start``: the (B,) int32 first valid key per batch row (template
    ``KV_START``), else a (1,) dummy; ``sinks``: the (Hq,) float32 sink logits (template
    ``SINKS``), else a (1,) dummy."""
    starts = np.zeros(1, np.int32) if kv_start is None else np.asarray(kv_start, np.int32)
    sink = np.zeros(1, np.float32) if sinks is None else np.asarray(sinks, np.float32)
    exe = build(template, kernel)
    with tempfile.TemporaryDirectory() as tmp:
        fin, fout = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
        blob = b"".join([_geom(q), _geom(k), _geom(v), _geom(k_scale), _geom(v_scale),
                         np.asarray(fparams, np.float32).tobytes(),
                         np.asarray(iparams, np.int32).tobytes(),
                         struct.pack("<q", starts.size), starts.tobytes(),
                         struct.pack("<q", sink.size), sink.tobytes(),
                         struct.pack("<6q", grid[0], grid[1], grid[2], threads, smem,
                                     out_elems)])
        fin.write_bytes(blob)
        res = _run([str(exe), str(fin), str(fout)], timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"emulated kernel failed ({res.returncode}): {res.stderr[-3000:]}")
        raw = fout.read_bytes()
    dt = np.float32 if dict(template)["T"] == "float32" else np.uint16
    return np.frombuffer(raw, dt).copy()


# ---------------------------------------------------------------------------------------------
# Any registered CUDA twin (GEMM, SwiGLU, RMSNorm + QKV, dequantize): the generic runner

_SMEM_DECL = re.compile(r"extern __shared__ __align__\(\d+\) unsigned char smem\[\];")


def _ctype(dtype) -> str:
    return cudacheck.CUDA_TYPES[str(dtype).replace("mlx.core.", "")]


def _generic_source(name: str, input_dtypes, output_dtypes, template) -> str:
    """Host program for one launch of twin ``name``: the body inside a function with MLX's
    generated parameters (``<input>_shape`` / ``_strides`` / ``_ndim`` where the body uses
    them) and template constants, and a main that reads the inputs and geometry from a file."""
    spec = kernels.spec(name)
    _, header, body = kernels.kernel_source(name, "cuda")
    body, n = _SMEM_DECL.subn("unsigned char* smem = emu::blk->smem;", body)
    assert n <= 1, "one dynamic shared-memory declaration per body"
    params, args = [], []
    for i, (iname, dt) in enumerate(zip(spec.inputs_for("cuda"), input_dtypes)):
        ct = _ctype(dt)
        params.append(f"const {ct}* {iname}")
        args.append(f"reinterpret_cast<const {ct}*>(ins[{i}].ptr)")
        for suffix, ptype, field in (("shape", "Shape", "shape"), ("strides", "Strides", "strides"),
                                     ("ndim", "int", "ndim")):
            if f"{iname}_{suffix}" in body:
                params.append(f"const {ptype} {iname}_{suffix}")
                args.append(f"ins[{i}].{field}")
    for j, (oname, dt) in enumerate(zip(spec.output_names, output_dtypes)):
        ct = _ctype(dt)
        params.append(f"{ct}* {oname}")
        args.append(f"reinterpret_cast<{ct}*>(outs[{j}].data())")
    consts = [line.rstrip("\n") for line in template_lines(template, _ctype)]
    return "\n".join([
        '#include "warp_emu.h"',
        header,
        "using Shape = std::array<int32_t, 10>;",
        "using Strides = std::array<int64_t, 10>;",
        f"static void kernel_fn({', '.join(params)}) {{",
        *consts,
        body,
        "}",
        _GENERIC_MAIN.replace("@ARGS@", ", ".join(args)),
    ])


_GENERIC_MAIN = r"""
struct In {
  Shape shape{};
  Strides strides{};
  int ndim = 0;
  unsigned char* ptr = nullptr;
};
static int64_t rd(FILE* f) {
  int64_t v;
  if (std::fread(&v, 8, 1, f) != 1) std::abort();
  return v;
}
int main(int argc, char** argv) {
  FILE* f = std::fopen(argv[1], "rb");
  const int64_t n_in = rd(f);
  std::vector<In> ins(static_cast<size_t>(n_in));
  for (auto& in : ins) {
    in.ndim = int(rd(f));
    for (int d = 0; d < 10; ++d) in.shape[d] = int32_t(rd(f));
    for (int d = 0; d < 10; ++d) in.strides[d] = rd(f);
    const int64_t nbytes = rd(f);
    const int64_t offset = rd(f);  // bytes past a 64-byte aligned start
    const size_t bytes = size_t(nbytes + offset + 64) / 64 * 64 + 64;
    in.ptr = static_cast<unsigned char*>(std::aligned_alloc(64, bytes)) + offset;
    if (nbytes && std::fread(in.ptr, 1, size_t(nbytes), f) != size_t(nbytes)) std::abort();
  }
  const int64_t n_out = rd(f);
  std::vector<std::vector<unsigned char>> outs(static_cast<size_t>(n_out));
  for (auto& o : outs) o.assign(size_t(rd(f)), 0xFF);  // poison: NaN bits
  int64_t g[5];
  for (auto& x : g) x = rd(f);
  std::fclose(f);
  emu::launch(emu::Dim3{unsigned(g[0]), unsigned(g[1]), unsigned(g[2])}, int(g[3]), uint32_t(g[4]),
              0, 0, [&] { kernel_fn(@ARGS@); });
  FILE* o = std::fopen(argv[2], "wb");
  for (auto& x : outs) std::fwrite(x.data(), 1, x.size(), o);
  std::fclose(o);
  return 0;
}
"""


def _build_source(src: str, tag: str) -> Path:
    """Compile host program ``src`` (cached by its hash) with warp_emu.h; returns its path."""
    tc = toolchain()
    if tc is None:
        raise FileNotFoundError("no host C++ compiler or CUDA headers for the CUDA emulator")
    cxx, inc = tc
    flags = _SANITIZE_FLAGS if _sanitize() else []
    opts = [cxx, "-std=c++20", "-O1", *flags, "-pthread", "-w", "-I", str(HERE), "-I",
            str(CUDA_SRC), "-I", inc]
    emu_headers = "".join(h.read_text() for h in sorted(HERE.glob("*.h")))  # included by path
    digest = hashlib.sha1((src + emu_headers + " ".join(opts)).encode()).hexdigest()[:16]
    exe = _CACHE / f"{tag}_{digest}"
    if exe.is_file():
        return exe
    _CACHE.mkdir(parents=True, exist_ok=True)
    cpp = _CACHE / f"{tag}_{digest}.cpp"
    cpp.write_text(src)
    tmp = exe.with_suffix(f".tmp{os.getpid()}")
    cmd = [*opts, "-o", str(tmp), str(cpp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"host compile failed:\n{res.stderr[-6000:]}")
    os.replace(tmp, exe)
    return exe


def run_kernel(name: str, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(),
               shared_memory: int = 0, offsets=None):
    """Run one launch of CUDA twin ``name`` on the CPU, as ``kernels.launch`` would on the GPU.

    Args:
        inputs: ``mx.array`` per input of the spec (passed row-contiguous, MLX's strides; for a
            spec with ``ensure_row_contiguous=False``, views as they are).
        output_shapes, output_dtypes, grid (threads, MLX's convention), threadgroup, template,
            shared_memory: the launch's arguments.
        offsets: per input, bytes past a 64-byte boundary where its data starts (default 0),
            to drive the unaligned load paths.

    Returns:
        The outputs as ``mx.array`` (unwritten elements keep the NaN-bits poison).
    """
    import mlx.core as mx

    exe = _build_source(_generic_source(name, [a.dtype for a in inputs], output_dtypes,
                                        template), f"twin_{name}")
    offsets = offsets or [0] * len(inputs)
    if len(offsets) != len(inputs):  # zip would drop the inputs past the shorter list
        raise ValueError(f"offsets has {len(offsets)} entries for {len(inputs)} inputs")
    parts = [struct.pack("<q", len(inputs))]
    views = not kernels.spec(name).ensure_row_contiguous
    for a, off in zip(inputs, offsets):
        if views:  # as MLX passes them: a view's own strides over the memory it spans
            from mlx_bricks.emulator import _to_input

            t = _to_input(a, row_contiguous=False)
            raw = np.ascontiguousarray(t.data).view(np.uint8).tobytes()
            shape = list(t.shape) + [0] * (10 - len(t.shape))
            strides = list(t.strides) + [0] * (10 - len(t.strides))
            parts.append(struct.pack("<21q", len(t.shape), *shape, *strides) +
                         struct.pack("<2q", len(raw), off) + raw)
            continue
        a = mx.contiguous(a)
        raw = np.array(a.reshape(-1).view(mx.uint8)).tobytes() if a.size else b""
        shape = list(a.shape) + [0] * (10 - a.ndim)
        strides, acc = [0] * 10, 1
        for d in range(a.ndim - 1, -1, -1):
            strides[d] = acc
            acc *= a.shape[d]
        parts.append(struct.pack("<21q", a.ndim, *shape, *strides) +
                     struct.pack("<2q", len(raw), off) + raw)
    nbytes = [int(np.prod(sh)) * dt.size for sh, dt in zip(output_shapes, output_dtypes)]
    parts.append(struct.pack(f"<{1 + len(nbytes)}q", len(nbytes), *nbytes))
    blocks = [-(-g // t) for g, t in zip(grid, threadgroup)]
    parts.append(struct.pack("<5q", *blocks, threadgroup[0], shared_memory))
    with tempfile.TemporaryDirectory() as tmp:
        fin, fout = Path(tmp) / "in.bin", Path(tmp) / "out.bin"
        fin.write_bytes(b"".join(parts))
        res = _run([str(exe), str(fin), str(fout)], timeout=900)
        if res.returncode != 0:
            raise RuntimeError(f"emulated {name} failed ({res.returncode}): {res.stderr[-3000:]}")
        raw = fout.read_bytes()
    outs, pos = [], 0
    for sh, dt, n in zip(output_shapes, output_dtypes, nbytes):
        buf = np.frombuffer(raw[pos:pos + n], np.uint8).copy()
        pos += n
        outs.append(mx.array(buf).view(dt).reshape(sh))
    return outs


@contextlib.contextmanager
def emulated_launches(*modules, offsets=None):
    """Within the block, ``launch`` in each of ``modules`` (modules that did
    ``from mlx_bricks.kernels import launch``) runs its CUDA launches through
    :func:`run_kernel` on the CPU and returns their outputs, so an op's whole CUDA path
    (geometry, template, inputs, chained launches) runs without a GPU. ``offsets``: kernel
    name -> {input name: bytes past a 64-byte boundary} (:func:`run_kernel`'s offsets, by the
    spec's input names). Yields the list of launched kernel names."""
    from mlx_bricks import kernels
    names: list[str] = []

    def fake(name, backend, *, shared_memory=0, inputs, output_shapes, output_dtypes, grid,
             threadgroup, template=(), init_value=None):
        if backend != "cuda":
            raise ValueError(f"emulated_launches runs cuda launches only, got {backend!r}")
        if init_value is not None:
            raise NotImplementedError("init_value is not emulated")
        names.append(name)
        by_name = (offsets or {}).get(name)
        off = None  # (a launch may pass fewer inputs than its spec names: optional ones)
        if by_name:
            off = [by_name.get(n, 0) for n in kernels.spec(name).input_names[:len(inputs)]]
            off += [0] * (len(inputs) - len(off))
        return run_kernel(name, inputs, output_shapes, output_dtypes, grid, threadgroup,
                          template, shared_memory, offsets=off)

    with cudacheck.launches_replaced(fake, *modules):
        yield names
