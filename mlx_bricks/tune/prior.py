"""Decisions without measurement, for processes that must not delay their first token.

``tune="cached"`` (the one-shot commands' default: ``mlx_lm.generate``, ``chat``) never times
anything on the request path. A piece's decision comes from the decision cache (what
``python -m mlx_bricks.tune``, a server or an ``auto`` run measured on this device) and, where
the cache has none, from :func:`prior_decision`: rules drawn from the measurements committed in
``bench/results`` (the composites "dequantize in row tiles, then the float computation" beat
stock by 1.4-4.5x on the H200 at M >= 512 with 4-bit weights, 1.1-3.4x with 8-bit at M > 512,
and 14-65x on the CPU with float16/bfloat16 activations; float weights keep stock; 2026-12-02/04).

Building is part of the cost: a kernel variant is compiled once per process (NVRTC on CUDA, the
Metal compiler on Metal; MLX does not keep ``mx.fast`` custom kernels across processes).
:func:`pays` keeps a cached kernel winner only where its measured gain over the calls this
process is expected to make exceeds its build time; otherwise the fastest measured variant that
needs no build, or stock.
"""
from __future__ import annotations

import re

from mlx_bricks.tune.tuner import MIN_SPEEDUP, STOCK, Decision

#: Backends whose kernel variants are compiled in the process that first runs them.
BUILD_BACKENDS = ("cuda", "metal")
#: Seconds one kernel variant's build costs a process when nothing measured says otherwise
#: (H100, 2026-12-05: about 9 s for the 6-8 NVRTC builds of an 8B prefill's tail chunk).
BUILD_S = {"cuda": 1.5, "metal": 0.3}
#: Prior: the fewest rows (tokens of a chunk) from which a quantized weight's composite
#: replaces stock, per backend and weight bits (None: stock at every M). The CPU's stock
#: float16/bfloat16 ``quantized_matmul`` is tens of times slower at any M; CUDA's 4-bit
#: composite won from the M <= 512 bucket on, 8-bit's only above it (bench/results/
#: 2026-12-03-h200-e2e-quant.json). Metal: nothing measured on Apple GPUs yet, stock.
PRIOR_MIN_ROWS = {"reference": {4: 2, 8: 2}, "cuda": {4: 256, 8: 1024}}
#: Prior on CUDA: weights below this many elements (N x K) keep stock (an N=512, K=2048 linear
#: stayed stock at every M on the H200: the dequantize pass does not amortise).
PRIOR_MIN_WEIGHT = {"cuda": 4 * 2**20}
#: Activation dtypes the prior sends to a composite on the CPU (float32's stock quantized
#: matmul was not measured slower).
CPU_DTYPES = ("float16", "bfloat16")
#: The kinds whose composites the prior may choose, per backend: those measured against stock
#: there (bench/results). CUDA: the dense GEMM family; the MoE composite (every expert
#: dequantized) was not measured on a GPU. CPU: the MoE composite too (gpt_oss-shaped, mxfp4
#: experts: 3.1-5.4x stock, 2026-12-05-cpu-formats*.json).
PRIOR_KINDS = {"cuda": ("linear", "rms_norm_qkv", "swiglu_mlp"),
               "reference": ("linear", "rms_norm_qkv", "swiglu_mlp", "moe_mlp")}
#: Microscaled formats (mlx-lm's mxfp4 / nvfp4 / mxfp8 modes) the prior treats like 4- / 8-bit
#: weights: on the CPU their composites ran 10-28x stock (2026-12-05-cpu-formats*.json).
MICROSCALED_BITS = {"mxfp4": 4, "nvfp4": 4, "mxfp8": 8}
#: Backends where the prior knows the microscaled formats (their composites measured there).
MICROSCALED_BACKENDS = ("reference",)
#: The fewest rows from which the CPU prior runs bfloat16 weights' products through NumPy's
#: float32 BLAS (the float32 copies of x and of the weight rows cost O(M K + N K) against the
#: product's O(M N K)); the only float weights the CPU patches (``Dispatch.admits``).
PRIOR_MIN_ROWS_FLOAT_CPU = 16
#: Composite preferred by the prior, per kind (the one that won most often in bench/results).
PREFERRED = {"swiglu_mlp": "dequant_split"}
#: Where MLX runs on the CPU, the composites preferred first, in order: the products through
#: NumPy's float32 BLAS (26x MLX's bf16 CPU matmul on a 512 x 2048 x 2048 product, 2-core x86,
#: 2026-12-06; ``bricks/dequantize/composite.py``), the SwiGLU's gate and up as one product.
PREFERRED_CPU = ("blas_fused", "blas", "blas_split")

#: The first-token guard (one-shot commands; ``nn.gate``): seconds by which a process's first
#: bricks prefill is later than stock's beyond what its GEMMs save, per backend. H100, MLX 0.32.4,
#: Llama-3-8B-shaped 4-bit: 32 layers, first 2,048-token call 0.62 s vs stock 0.48 s, later
#: calls 0.08 vs 0.24 s (one-off ~0.30 s); 8 layers, fresh ``mlx_lm.generate`` processes,
#: 2,240 tokens: TTFT 0.77-0.86 s vs stock 0.63 s (bench/results/2026-12-05-h100-user-path.json).
#: 2026-12-06, two H100s, fresh processes, 32 layers, the first layer of the first 2,048-token
#: call: 0.36-0.39 s vs stock 0.175 s, and 0.67 vs 0.30-0.31 s (one-off 0.19-0.36 s; the first
#: cuBLAS GEMM alone 0.083 s; bench/results/2026-12-06-h100-first-call.jsonl): 0.40 keeps stock
#: wherever the bricks could come later. Backends not listed have no measured one-off cost (the
#: CPU: its first run is 32x stock).
FIRST_PREFILL_S = {"cuda": 0.40}
#: Seconds the bricks save per prompt token and GiB of affine-quantized linear weights once
#: warm: the 32-layer figures above, 0.16 s per 2,048 tokens over 3.66 GiB of 4-bit gs64 weights.
#: Other pieces bring their own rate (:func:`saved_s_per_token`: a mixer piece's
#: ``prior_saving``).
SAVED_S_PER_TOKEN_GIB = {"cuda": 21e-6}

_BITS = re.compile(r"q(\d+)g\d+")


def _bits(weights: str, backend: str) -> int | None:
    """The largest bits of a key's weight formats (``"q4g64/q8g64"`` -> 8; a microscaled mode
    counts as its bits where :data:`MICROSCALED_BACKENDS` has the backend), None if any is
    float or unknown."""
    bits = []
    for part in weights.split("/"):
        m = _BITS.fullmatch(part)
        if m is not None:
            bits.append(int(m.group(1)))
        elif part in MICROSCALED_BITS and backend in MICROSCALED_BACKENDS:
            bits.append(MICROSCALED_BITS[part])
        else:
            return None
    return max(bits) if bits else None


def _weight_elements(args: dict) -> int:
    """The largest weight's N x K among ``args`` (0 when none has a shape)."""
    sizes = [a.shape[0] * a.shape[1] for n, a in args.items()
             if n.startswith("w") and getattr(a, "shape", None) is not None and len(a.shape) == 2]
    return max(sizes, default=0)


def prior_decision(kind, args: dict, candidates: list, backend: str, full_key: str) -> Decision:
    """The decision for a piece nothing measured (source ``"prior"``; not cached).

    The kind's own rule first (``OpKind.prior``: a no-build variant's name, ``"stock"``, or
    None to defer); then a composite that needs no kernel build wins where
    :data:`PRIOR_MIN_ROWS` and :data:`PRIOR_MIN_WEIGHT` say it beat stock on this kind of
    device, and on the CPU the NumPy-BLAS composite of bfloat16 weights from
    :data:`PRIOR_MIN_ROWS_FLOAT_CPU` rows; everything else (other float weights, kernel
    variants, attention, backends without measurements) keeps stock.
    Source: bench/results (2026-12-02 CPU, 2026-12-03/04 H200), module docstring.
    """
    key = kind.key(args)
    measured = kind.measured(args)
    why = "prior: stock (nothing measured on this device for this shape)"
    own = kind.prior(args, backend)  # a kind's own rule, from its measurements
    if own is not None:
        v = next((c for c in candidates if c.name == own and not c.builds), None)
        if v is None:
            return Decision(full_key, STOCK, measured=measured, source="prior", note=why)
        return Decision(full_key, v.name, dict(v.kwargs), measured=measured, source="prior",
                        note=f"prior: {v.name} ({kind.name}'s rule, no build)")
    bits = _bits(key.weights, backend)
    if bits is None and backend == "reference" and kind.name in PRIOR_KINDS["reference"]:
        blas = next((v for n in PREFERRED_CPU for v in candidates
                     if v.name == n and not v.builds), None)
        rows = measured.get("M")
        if (blas is not None and key.dtype == "bfloat16"
                and set(key.weights.split("/")) == {"float"}
                and isinstance(rows, int) and rows >= PRIOR_MIN_ROWS_FLOAT_CPU):
            return Decision(full_key, blas.name, dict(blas.kwargs), measured=measured,
                            source="prior", note=f"prior: {blas.name} (bfloat16 weights through "
                            "NumPy's float32 BLAS on the CPU; Dispatch.admits)")
    rows_by_bits = PRIOR_MIN_ROWS.get(backend)
    if bits is None or rows_by_bits is None or kind.name not in PRIOR_KINDS.get(backend, ()):
        return Decision(full_key, STOCK, measured=measured, source="prior", note=why)
    min_rows = rows_by_bits.get(8 if bits > 4 else 4)
    rows = measured.get("M")
    if (min_rows is None or not isinstance(rows, int) or rows < min_rows
            or _weight_elements(args) < PRIOR_MIN_WEIGHT.get(backend, 0)
            or (backend == "reference" and key.dtype not in CPU_DTYPES)):
        return Decision(full_key, STOCK, measured=measured, source="prior", note=why)
    free = [v for v in candidates if not v.builds]
    if not free:
        return Decision(full_key, STOCK, measured=measured, source="prior", note=why)
    want = PREFERRED.get(kind.name)
    best = next((v for v in free if v.name == want), free[0])
    if backend == "reference":
        best = next((v for n in PREFERRED_CPU for v in free if v.name == n), best)
    return Decision(full_key, best.name, dict(best.kwargs), measured=measured, source="prior",
                    note=f"prior: {best.name} (composite, no build; bench/results)")


def pays(decision: Decision, backend: str, calls: int, built: bool,
         build_s: float | None = None) -> bool:
    """Whether running ``decision``'s kernel winner pays for its build in this process:
    ``(stock s - winner s) x calls >= build s``. True when the winner needs no build here
    (``built``, or a backend that builds nothing); False when the decision lacks timings.

    Args:
        calls: calls of this piece the process is expected to make (e.g. one per layer).
        build_s: the kernel's measured build time, else :data:`BUILD_S`.
    """
    if built or backend not in BUILD_BACKENDS:
        return True
    s = (decision.variants.get(decision.winner) or {}).get("s")
    if decision.stock_s is None or s is None:
        return False
    cost = BUILD_S[backend] if build_s is None else build_s
    return (decision.stock_s - s) * max(1, calls) >= cost


def without_builds(decision: Decision, free: set[str], full_key: str) -> Decision:
    """``decision`` restricted to the variants in ``free`` (no build): the fastest measured
    one where it beats stock by :data:`MIN_SPEEDUP`, else stock."""
    timed = {n: v["s"] for n, v in decision.variants.items()
             if n in free and v.get("ok") and v.get("s")}
    note = f"cache: {decision.winner} would not pay its build in this process"
    if not timed or decision.stock_s is None:
        return Decision(full_key, STOCK, measured=decision.measured, source="cache", note=note)
    best = min(timed, key=timed.get)
    ratio = decision.stock_s / timed[best]
    if ratio >= MIN_SPEEDUP:
        return Decision(full_key, best, {}, ratio, decision.stock_s, decision.variants,
                        decision.measured, source="cache", note=note)
    return Decision(full_key, STOCK, {}, ratio, decision.stock_s, decision.variants,
                    decision.measured, source="cache", note=note)


def min_prompt_tokens(backend: str, saved_per_token: float) -> float:
    """The shortest prompt whose first bricks prefill in a process is expected to come no later
    than stock's: ``FIRST_PREFILL_S / saved_per_token``.

    Args:
        backend: the bricks' backend name (``"cuda"``, ``"metal"``, ``"reference"``).
        saved_per_token: seconds the model's patched pieces save per prompt token once warm
            (:func:`saved_s_per_token`).

    Returns:
        0 where no one-off cost was measured (every prompt runs the bricks),
        ``float("inf")`` where nothing the bricks do is measured to save time, else the token
        count (a float).
    """
    cost = FIRST_PREFILL_S.get(backend)
    if not cost:
        return 0
    return cost / saved_per_token if saved_per_token > 0 else float("inf")


def saved_s_per_token(backend: str, modules) -> float:
    """Seconds per prompt token the patched ``modules`` of one model are expected to save on
    ``backend`` once warm, summed over their pieces (a cost model per model, not per GiB):

    * dense affine-quantized linears run by the block, attention and MLP pieces:
      :data:`SAVED_S_PER_TOKEN_GIB` per GiB (:func:`quantized_linear_bytes`);
    * a module whose piece has ``prior_saving(module, backend)`` (a token mixer of
      ``patch.modules.MIXERS``: seconds per token it saves there, from its brick's own
      measurements, e.g. a Gated DeltaNet layer against stock's token loop), plus its
      projections that run as ``linear`` stages (the piece's ``stage_names``: the GEMM brick,
      tuned as every linear) at the dense rate; the ones it keeps as its own layers (stock)
      are not counted.

    Pieces the prior keeps stock on ``backend`` (MoE experts and microscaled weights on CUDA,
    float weights) add nothing.
    """
    dense, stages, total = [], [], 0.0
    for m in modules:
        piece = getattr(getattr(m, "_bricks_state", None), "piece", None)
        saving = getattr(piece, "prior_saving", None)
        if saving is None:
            dense.append(m)
            continue
        total += saving(m, backend)
        names = getattr(piece, "stage_names", None)
        stages += [m[n] for n in (names(m, None) if names is not None else ())]
    return total + (SAVED_S_PER_TOKEN_GIB.get(backend, 0.0)
                    * quantized_linear_bytes(dense + stages) / 2**30)


def quantized_linear_bytes(modules) -> int:
    """Bytes of the affine-quantized dense linears (``nn.QuantizedLinear``: packed weight,
    scales, biases) inside ``modules``, each counted once (what :func:`min_prompt_tokens`
    weighs)."""
    import mlx.nn as nn

    seen: set[int] = set()
    total = 0
    for module in modules:
        for sub in module.modules():
            if isinstance(sub, nn.QuantizedLinear) and id(sub) not in seen:
                seen.add(id(sub))
                total += sum(getattr(sub, n).nbytes for n in ("weight", "scales", "biases")
                             if getattr(sub, n, None) is not None)
    return total
