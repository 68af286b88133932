"""GPU benchmarks of the bricks against stock MLX in the same process (``--backend cuda``).

Every entry times the brick and the stock MLX computation of the same op on the same inputs,
several calls per ``mx.eval`` (MLX's per-eval overhead, about 58 us on the H200, would otherwise
dominate small ops), after a warm-up, with ``mx.synchronize``, and reports the median of the
repeats, TFLOP/s and the same-process ratio stock_time / brick_time (> 1: the brick is faster),
plus the largest difference between the two outputs relative to the stock output's magnitude.

Shapes are a llama-3-8B layer's (hidden 4096, intermediate 14336, 32 query / 8 KV heads,
head_dim 128) at prefill chunk sizes M = 512, 2048, 8192; weights bf16, MLX affine 4-bit gs64
and 8-bit gs64 (``mx.quantize``, what ``nn.quantize`` makes). Families (``python -m
mlx_bricks.bench --only GROUP``, groups in ``mlx_bricks.bench.core``):

- ``linear_cases`` / ``swiglu_cases`` / ``rms_norm_qkv_cases``: the GEMM twins with the tile
  rule (group ``cuda_kernels``), and per tile (``cuda_tiles``: every linear tile, split-K
  included, and every fused SwiGLU tile, on 4- and 8-bit gs64 weights);
- ``dequantize_cases``: the dequantize twin vs ``mx.dequantize`` (``cuda_dequantize``; GB/s);
- ``attention_cases``: the attention twin vs ``mx.fast.scaled_dot_product_attention``
  (``cuda_attention``), ``decode_cases``: the decode twin over Q8_0 / float16 K/V vs stock SDPA
  over float16 (``cuda_decode``): the timing halves of the former scripts/gpu checks;
- ``kv_cache_cases``: a 16k-token prefill into the Q8_0 cache vs the float16 cache, with peak
  memory (``cuda_kv_cache``).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
M_SIZES = (512, 2048, 8192)
#: Weight formats: None (the activation dtype) or (bits, group_size).
FORMATS = (None, (4, 64), (8, 64))


def fmt_name(fmt) -> str:
    return "bf16" if fmt is None else f"q{fmt[0]}g{fmt[1]}"


def time_op(fn: Callable, *, target_s: float = 0.02, repeats: int = 5) -> float:
    """Median seconds of one call of ``fn`` (returns mx.array(s)), timing ``n`` calls per
    ``mx.eval`` with ``n`` chosen so one eval takes about ``target_s``."""
    import mlx.core as mx

    mx.eval(fn())
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    n = max(1, min(200, int(target_s / one)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(n)])
        mx.synchronize()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def rel_diff(a, b) -> float:
    """max |a - b| / max(1, max |b|), in float32."""
    import mlx.core as mx

    a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.max(mx.abs(a32 - b32)).item()) / max(1.0, float(mx.max(mx.abs(b32)).item()))


@dataclass
class Case:
    """One op at one shape: ``build() -> (brick, stock, flops)`` or ``(brick, stock, flops,
    info)`` with ``info`` a dict of facts merged into the result (e.g. ``bytes`` moved)."""

    name: str
    build: Callable


def _randn(shape, dtype, seed, scale=1.0):
    import mlx.core as mx

    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(dtype)


def _weight(N, K, fmt, dtype, seed):
    """(weight for the brick, stock callable factory) for a float or affine weight."""
    import mlx.core as mx

    from mlx_bricks.formats.affine import QuantizedWeight

    w = _randn((N, K), dtype, seed, K ** -0.5)
    if fmt is None:
        return w, (lambda x: x @ w.T)
    bits, gs = fmt
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    qw = QuantizedWeight(q, s, b, gs, bits)
    return qw, (lambda x: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs,
                                              bits=bits))


#: The 8B layer's projections, (N, K).
SHAPES = {"qo": (HIDDEN, HIDDEN), "kv": (KV_HEADS * HEAD_DIM, HIDDEN),
          "gate_up": (INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}
#: Weight formats of the per-tile cases (the ones the quantized models use).
QUANT_FORMATS = ((4, 64), (8, 64))


def linear_cases(backend: str, dtype_name: str = "bfloat16", tiles=(None,), formats=FORMATS,
                 shapes=tuple(SHAPES)):
    import mlx.core as mx

    from mlx_bricks import ops

    from mlx_bricks.bricks.gemm.cuda import LINEAR_TILES

    dtype = getattr(mx, dtype_name)
    shapes = {k: SHAPES[k] for k in shapes}
    for fmt in formats:
        for sname, (N, K) in shapes.items():
            for M in M_SIZES:
                for tile in tiles:
                    if tile is not None and fmt and fmt[0] > LINEAR_TILES[tile].max_bits:
                        continue  # the tile does not take that many bits (ptxas spills)
                    def build(M=M, N=N, K=K, fmt=fmt, tile=tile):
                        x = _randn((M, K), dtype, 1)
                        w, stock = _weight(N, K, fmt, dtype, 2)
                        mx.eval(x, w if not hasattr(w, "w") else w.w)
                        return (lambda: ops.linear(x, w, tile=tile, backend=backend),
                                lambda: stock(x), 2.0 * M * N * K)
                    yield Case(f"linear_{fmt_name(fmt)}_{sname}_M{M}_{tile or 'rule'}", build)


def swiglu_cases(backend: str, dtype_name: str = "bfloat16", variants=("fused", "split"),
                 tiles=(None,), split_tiles=(None,), formats=FORMATS):
    """SwiGLU (gate and up of the 8B MLP) per variant and, with ``tiles`` / ``split_tiles``,
    per fused tile (``SWIGLU_TILES``) / per GEMM tile of both split launches (``TILES``)."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_bricks import ops
    from mlx_bricks.bricks.gemm.cuda import TILES
    from mlx_bricks.bricks.swiglu.cuda import SWIGLU_TILES

    dtype = getattr(mx, dtype_name)
    N, K = INTERMEDIATE, HIDDEN
    for fmt in formats:
        for M in M_SIZES:
            for variant in variants:
                table = SWIGLU_TILES if variant == "fused" else TILES
                for tile in (tiles if variant == "fused" else split_tiles):
                    if tile is not None and fmt and fmt[0] > table[tile].max_bits:
                        continue
                    def build(M=M, fmt=fmt, variant=variant, tile=tile):
                        x = _randn((M, K), dtype, 1)
                        wg, gate = _weight(N, K, fmt, dtype, 2)
                        wu, up = _weight(N, K, fmt, dtype, 3)
                        mx.eval(x)
                        return (lambda: ops.swiglu(x, wg, wu, variant=variant, tile=tile,
                                                   backend=backend),
                                lambda: nn.silu(gate(x)) * up(x), 4.0 * M * N * K)
                    suffix = "" if tile is None else f"_{tile}"
                    yield Case(f"swiglu_{variant}_{fmt_name(fmt)}_M{M}{suffix}", build)


def rms_norm_qkv_cases(backend: str, dtype_name: str = "bfloat16", tiles=(None,),
                       formats=FORMATS):
    """RMSNorm + Q/K/V of the 8B layer, with the tile rule or, with ``tiles``, per tile."""
    import mlx.core as mx

    from mlx_bricks import ops
    from mlx_bricks.bricks.gemm.cuda import TILES

    dtype = getattr(mx, dtype_name)
    K, D = HIDDEN, HEAD_DIM
    for fmt in formats:
        for M in M_SIZES:
            for tile in tiles:
                if tile is not None and fmt and fmt[0] > TILES[tile].max_bits:
                    continue
                def build(M=M, fmt=fmt, tile=tile):
                    x = _randn((1, M, K), dtype, 1)
                    nw = _randn((K,), dtype, 4) + 1
                    wq, sq = _weight(HEADS * D, K, fmt, dtype, 2)
                    wk, sk = _weight(KV_HEADS * D, K, fmt, dtype, 3)
                    wv, sv = _weight(KV_HEADS * D, K, fmt, dtype, 5)
                    mx.eval(x, nw)

                    def stock():
                        h = mx.fast.rms_norm(x, nw, 1e-5)
                        return [p(h).reshape(1, M, n, D).transpose(0, 2, 1, 3)
                                for p, n in ((sq, HEADS), (sk, KV_HEADS), (sv, KV_HEADS))]

                    def brick():
                        return list(ops.rms_norm_qkv(x, nw, 1e-5, wq, wk, wv, n_heads=HEADS,
                                                     n_kv_heads=KV_HEADS, head_dim=D,
                                                     tile=tile, backend=backend))
                    return brick, stock, 2.0 * M * (HEADS + 2 * KV_HEADS) * D * K
                suffix = "" if tile is None else f"_{tile}"
                yield Case(f"rms_norm_qkv_{fmt_name(fmt)}_M{M}{suffix}", build)


def dequantize_cases(backend: str = "cuda", dtype_name: str = "bfloat16",
                     bits_list=(4, 8), group_size: int = 64):
    """The dequantize twin (``bricks.dequantize.cuda``) vs ``mx.dequantize`` on each 8B
    projection's weight; ``bytes`` (packed words, scales, biases read, output written) in the
    result, so GB/s follow from the times."""
    import mlx.core as mx

    from mlx_bricks.bricks.dequantize.cuda import dequantize_cuda

    dtype = getattr(mx, dtype_name)
    for bits in bits_list:
        for sname, (N, K) in SHAPES.items():
            def build(N=N, K=K, bits=bits):
                w = _randn((N, K), dtype, 2, K ** -0.5)
                q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
                mx.eval(q, s, b)
                moved = q.nbytes + s.nbytes + b.nbytes + N * K * dtype.size
                return (lambda: dequantize_cuda(q, s, b, bits=bits, group_size=group_size),
                        lambda: mx.dequantize(q, s, b, group_size=group_size, bits=bits),
                        0.0, {"bytes": moved})
            yield Case(f"dequantize_{fmt_name((bits, group_size))}_{sname}", build)


def attention_cases(dtype_name: str = "bfloat16"):
    """Causal prefill attention, batch 1: the twin (``launch_attention_cuda``) vs stock SDPA on
    the same q / k / v (Q8_0 cases: the twin over Q8_0 K/V, stock over bf16); head_dim 64 / 128
    (32 / 8 heads), 256 / 512 (8 / 4), L 2048 / 8192, a Gemma-3 shaped window-512 layer and
    the alternative tile variants. TFLOP/s count the visible pairs."""
    import mlx.core as mx

    from mlx_bricks.bricks.attention import msl as _attention  # noqa: F401  (registers the kernel)
    from mlx_bricks.bricks.attention.op import causal_window_mask
    from mlx_bricks.bricks.attention.cuda import launch_attention_cuda, variants
    from mlx_bricks.bricks.q8_0.op import quantize_q8_0_reference

    dtype = getattr(mx, dtype_name)
    specs = [(D, hq, hkv, L, None, False, None)
             for D, hq, hkv in ((64, 32, 8), (128, 32, 8), (256, 8, 4), (512, 8, 4))
             for L in (2048, 8192)]
    specs += [(128, 32, 8, 8192, None, True, None), (256, 8, 4, 8192, None, True, None)]
    specs += [(256, 8, 4, L, 512, False, None) for L in (2048, 8192)]
    specs += [(D, hq, hkv, 8192, None, False, t.name)
              for D, hq, hkv in ((64, 32, 8), (256, 8, 4), (512, 8, 4))
              for t in variants(D, dtype)[1:]]
    for D, hq, hkv, L, window, q8, variant in specs:
        def build(D=D, hq=hq, hkv=hkv, L=L, window=window, q8=q8, variant=variant):
            q = _randn((1, hq, L, D), dtype, 1)
            k, v = _randn((1, hkv, L, D), dtype, 2), _randn((1, hkv, L, D), dtype, 3)
            kin, vin, ks, vs = k, v, None, None
            if q8:
                (kin, ks), (vin, vs) = quantize_q8_0_reference(k), quantize_q8_0_reference(v)
            mask = "causal" if window is None else causal_window_mask(L, L, window)
            mx.eval(q, k, v, kin, vin, *(a for a in (ks, vs, mask) if not isinstance(a, str)
                                         and a is not None))
            scale = D ** -0.5
            pairs = L * (L + 1) / 2 if window is None else sum(min(i + 1, window)
                                                                for i in range(L))
            return (lambda: launch_attention_cuda(q, kin, vin, ks, vs, scale=scale, causal=True,
                                                  window=window, variant=variant),
                    lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                 mask=mask),
                    4.0 * hq * pairs * D)
        name = (f"attention_D{D}_h{hq}x{hkv}_L{L}{'_q8_0' if q8 else ''}"
                f"{f'_window{window}' if window else ''}{f'_{variant}' if variant else ''}")
        yield Case(name, build)


def decode_cases(dtype_name: str = "float16"):
    """Decode (Lq = 1, and a 4-token causal draft) over a long KV cache, 32 query / 8 KV
    heads of 128: the twin over Q8_0 K/V and over float16 K/V vs stock SDPA over float16;
    ``bytes`` of K/V read per call in the result."""
    import mlx.core as mx

    from mlx_bricks.bricks.decode.op import decode_attention
    from mlx_bricks.bricks.q8_0.op import quantize_q8_0_reference

    dtype = getattr(mx, dtype_name)
    Hq, Hkv, D = 32, 8, 128
    for Lk, Lq in ((4096, 1), (32768, 1), (131072, 1), (32768, 4)):
        for kv in ("q8_0", "fp16"):
            def build(Lk=Lk, Lq=Lq, kv=kv):
                q = _randn((1, Hq, Lq, D), dtype, 1)
                k, v = _randn((1, Hkv, Lk, D), dtype, 2), _randn((1, Hkv, Lk, D), dtype, 3)
                kq, vq = quantize_q8_0_reference(k), quantize_q8_0_reference(v)
                mx.eval(q, k, v, kq, vq)
                mask = "causal" if Lq > 1 else None
                scale = D ** -0.5
                quant = kv == "q8_0"
                kin, vin = (kq, vq) if quant else (k, v)
                moved = 2 * Hkv * Lk * ((D + 2 * (D // 32)) if quant else 2 * D)

                def brick():
                    return decode_attention(q, kin, vin, scale=scale, mask=mask,
                                            kv_quant="q8_0" if quant else None, backend="cuda")

                def stock():
                    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
                return brick, stock, 4.0 * Hq * Lq * Lk * D, {"bytes": moved}
            yield Case(f"decode_{kv}_Lk{Lk}_Lq{Lq}", build)


def kv_cache_cases(n_tokens: int = 16384, chunk: int = 2048):
    """An 8B-shaped 4-layer llama (random bf16 weights) prefilling ``n_tokens`` in chunks of
    ``chunk`` into a fresh cache per call: the Q8_0 cache (``mlx_bricks.cache``, attention through
    the decode / prefill bricks) vs mlx-lm's float16 ``KVCache``; the result adds each side's
    peak memory (``mx.get_peak_memory`` over one call) and cache bytes. (The memory half of the
    former scripts/gpu/decode_cuda_check.py.)"""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache

    from mlx_bricks.cache import make_prompt_cache
    from mlx_bricks.tools.kv_driver import q8_0_attention

    def build():
        args = llama.ModelArgs(model_type="llama", hidden_size=HIDDEN, num_hidden_layers=4,
                               intermediate_size=INTERMEDIATE, num_attention_heads=HEADS,
                               num_key_value_heads=KV_HEADS, rms_norm_eps=1e-5,
                               vocab_size=32000, rope_theta=500000.0,
                               tie_word_embeddings=False)
        mx.random.seed(0)
        model = llama.Model(args)
        model.set_dtype(mx.bfloat16)
        mx.eval(model.parameters())
        toks = mx.random.randint(0, 32000, (1, n_tokens), key=mx.random.key(3))
        facts = {}

        def prefill(kind):
            cache = (make_prompt_cache(model, "q8_0", backend="cuda") if kind == "q8_0"
                     else [KVCache() for _ in model.layers])
            for lo in range(0, n_tokens, chunk):
                logits = model(toks[:, lo:lo + chunk], cache=cache)
                mx.eval([c.state for c in cache])
            facts[f"{kind}_cache_bytes"] = sum(c.nbytes for c in cache)
            return logits[:, -1]

        def brick():
            with q8_0_attention(model):
                return prefill("q8_0")

        for name, fn in (("q8_0", brick), ("fp16", lambda: prefill("fp16"))):
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            mx.eval(fn())
            mx.synchronize()
            facts[f"{name}_peak_bytes"] = mx.get_peak_memory()
        return brick, lambda: prefill("fp16"), 0.0, facts

    yield Case(f"kv_cache_llama8b_4layer_prefill_{n_tokens}", build)


def run_case(case: Case) -> dict:
    """Time one case; failures (compile errors, wrong shapes) are recorded, not raised."""
    import mlx.core as mx

    out = {"name": case.name}
    try:
        made = case.build()
        brick, stock, flops = made[:3]
        out.update(made[3] if len(made) > 3 else {})
        b_out, s_out = brick(), stock()
        b_list = b_out if isinstance(b_out, list) else [b_out]
        s_list = s_out if isinstance(s_out, list) else [s_out]
        mx.eval(b_list, s_list)
        out["rel_diff"] = max(rel_diff(b, s) for b, s in zip(b_list, s_list))
        tb, ts = time_op(brick), time_op(stock)
        out.update(brick_ms=tb * 1e3, stock_ms=ts * 1e3, ratio=ts / tb,
                   brick_tflops=flops / tb / 1e12, stock_tflops=flops / ts / 1e12)
        if "bytes" in out:
            out.update(brick_gbps=out["bytes"] / tb / 1e9, stock_gbps=out["bytes"] / ts / 1e9)
    except Exception as e:  # noqa: BLE001  (a benchmark run reports every case's outcome)
        out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    return out
