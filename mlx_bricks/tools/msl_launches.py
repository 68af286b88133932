"""Every MSL launch the bricks' ops make, recorded instead of run: the ops driven through every
configuration their tile rules and variant listings produce, on small operands, and the kernel
text MLX generates for each launch (``emulator.source.generate``). ``tools.mac_check`` compiles
them with Apple's compiler; ``tests/test_metal_src_rules.py`` reads their text.
"""
from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def recorded_msl_launches():
    """Within the block, every ``kernels.launch`` (also where a module imported it by name)
    records the launch instead of running it and returns zero arrays of the output shapes, so
    the ops' MSL paths can be driven without a GPU. Yields the list of records: (name,
    inputs, output_dtypes, template, threadgroup)."""
    import mlx.core as mx

    from mlx_bricks import kernels

    records = []
    real = kernels.launch

    def fake(name, backend, *, shared_memory=0, inputs, output_shapes, output_dtypes, grid,
             threadgroup, template=(), init_value=None):
        records.append((name, list(inputs), list(output_dtypes), list(template or []),
                        tuple(threadgroup)))
        return [mx.zeros(sh, dtype=dt) for sh, dt in zip(output_shapes, output_dtypes)]

    patched = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("mlx_bricks")
               and getattr(m, "launch", None) is real]
    try:
        for m in patched:
            m.launch = fake
        yield records
    finally:
        for m in patched:
            m.launch = real


def _drive_ops(backend: str) -> list[tuple[str, tuple]]:
    """Call every op on ``backend`` in every configuration its tile rules and variant listings
    produce, on small operands; returns (case, record) for each recorded launch."""
    import mlx.core as mx

    from mlx_bricks.bricks.attention import msl as attention_msl
    from mlx_bricks.bricks.attention import op as attention
    from mlx_bricks.bricks.decode import op as decode
    from mlx_bricks.bricks.dequantize import op as dequantize
    from mlx_bricks.bricks.gated_delta import op as gdn
    from mlx_bricks.bricks.gemm import op as gemm
    from mlx_bricks.bricks.moe import msl as moe_msl
    from mlx_bricks.bricks.moe import op as moe
    from mlx_bricks.bricks.norm_qkv import op as norm_qkv
    from mlx_bricks.bricks.q8_0 import op as q8_0
    from mlx_bricks.bricks.selective_scan import op as selective_scan
    from mlx_bricks.bricks.short_conv import op as short_conv
    from mlx_bricks.bricks.ssd import op as ssd
    from mlx_bricks.bricks.swiglu import op as mlp
    from mlx_bricks.formats.affine import QuantizedWeight

    dtypes = (mx.float16, mx.bfloat16, mx.float32)
    formats = [(bits, 64) for bits in (2, 3, 4, 5, 6, 8)] + [(4, 32), (4, 128)]

    def arr(shape, dt):
        return mx.zeros(shape, dt)

    def weight(n, k, dt, fmt):
        if fmt is None:
            return arr((n, k), dt)
        bits, gs = fmt
        w, s, b = mx.quantize(mx.ones((n, k), dt), group_size=gs, bits=bits)
        return QuantizedWeight(w, s, b, gs, bits)

    def fmt_name(fmt):
        return "float" if fmt is None else f"q{fmt[0]}g{fmt[1]}"

    out: list[tuple[str, tuple]] = []
    with recorded_msl_launches() as rec:
        def run(case, fn):
            n = len(rec)
            fn()
            out.extend((case, r) for r in rec[n:])

        for dt in dtypes:
            dn = str(dt).split(".")[-1]
            # GEMM: every tile on an aligned shape with bias and residual and a ragged one
            # (K tail, scalar loads); every weight format on the rule's tiles.
            for tile in gemm.tile_names(backend, dt):
                for fmt in (None, (4, 64)):
                    run(f"{dn} tile={tile} weight={fmt_name(fmt)} aligned",
                        lambda: gemm.linear(arr((128, 128), dt), weight(128, 128, dt, fmt),
                                            arr((128,), dt), arr((128, 128), dt), tile=tile,
                                            backend=backend))
                run(f"{dn} tile={tile} weight=float ragged",
                    lambda: gemm.linear(arr((33, 36), dt), arr((40, 36), dt), tile=tile,
                                        backend=backend))
            for fmt in formats:
                for tile in ("64x64", "32x32"):
                    run(f"{dn} tile={tile} weight={fmt_name(fmt)}",
                        lambda: gemm.linear(arr((40, 256), dt), weight(72, 256, dt, fmt),
                                            tile=tile, backend=backend))
            # SwiGLU: both variants on every tile; GELU-tanh; quantized weights.
            for variant in mlp.variant_names(backend, dt):
                for tile in mlp.tile_names(backend, variant, dt):
                    run(f"{dn} swiglu {variant} tile={tile} aligned",
                        lambda: mlp.swiglu(arr((128, 128), dt), arr((128, 128), dt),
                                           arr((128, 128), dt), b_gate=arr((128,), dt),
                                           b_up=arr((128,), dt), variant=variant, tile=tile,
                                           backend=backend))
                    run(f"{dn} swiglu {variant} tile={tile} ragged gelu",
                        lambda: mlp.swiglu(arr((33, 36), dt), arr((40, 36), dt),
                                           arr((40, 36), dt), activation="gelu_tanh",
                                           variant=variant, tile=tile, backend=backend))
                for fmt in formats:
                    run(f"{dn} swiglu {variant} weight={fmt_name(fmt)}",
                        lambda: mlp.swiglu(arr((40, 256), dt), weight(72, 256, dt, fmt),
                                           weight(72, 256, dt, fmt), variant=variant,
                                           backend=backend))
            # RMSNorm + QKV: every tile; mixed formats.
            for tile in norm_qkv.tile_names(backend, dt):
                run(f"{dn} rms_norm_qkv tile={tile}",
                    lambda: norm_qkv.rms_norm_qkv(
                        arr((1, 70, 128), dt), arr((128,), dt), 1e-5, arr((256, 128), dt),
                        arr((128, 128), dt), arr((128, 128), dt), arr((256,), dt),
                        arr((128,), dt), arr((128,), dt), n_heads=4, n_kv_heads=2,
                        head_dim=64, tile=tile, backend=backend))
            run(f"{dn} rms_norm_qkv weight=q4g64/q8g32/float ragged",
                lambda: norm_qkv.rms_norm_qkv(
                    arr((1, 33, 256), dt), arr((256,), dt), 1e-5, weight(256, 256, dt, (4, 64)),
                    weight(128, 256, dt, (8, 32)), arr((128, 256), dt), n_heads=4,
                    n_kv_heads=2, head_dim=64, backend=backend))
            # Attention: every head_dim (its tile config), masks, soft-cap, Q8_0 K/V.
            # Multi-head latent attention's value heads narrower than q/k (DV < D).
            for D, Dv in ((192, 128), (96, 64), (256, 128)):
                q, k, v = arr((1, 4, 40, D), dt), arr((1, 4, 70, D), dt), arr((1, 4, 70, Dv), dt)
                run(f"{dn} attention D={D} Dv={Dv} mask=causal",
                    lambda: attention.flash_attention(q, k, v, scale=0.1, mask="causal",
                                                      backend=backend))
            for D in attention_msl.SUPPORTED_HEAD_DIMS:
                q, kv = arr((1, 4, 40, D), dt), arr((1, 2, 70, D), dt)
                for mask, window, cap in ((None, None, None), ("causal", None, None),
                                          ("causal", 33, 50.0)):
                    for q8 in ((None, "q8_0") if D % 32 == 0 else (None,)):
                        run(f"{dn} attention D={D} mask={mask} window={window} cap={cap} "
                            f"kv={q8}",
                            lambda: attention.flash_attention(
                                q, kv, kv, scale=0.1, mask=mask, window=window, softcap=cap,
                                kv_quant=q8, backend=backend))
                # A left-padded batch (kv_start, KV_START): causal, window and soft-cap.
                qb, kvb = arr((2, 4, 40, D), dt), arr((2, 2, 70, D), dt)
                run(f"{dn} attention D={D} mask=causal window=33 cap=50.0 kv=None kv_start",
                    lambda: attention.flash_attention(
                        qb, kvb, kvb, scale=0.1, mask="causal", window=33, softcap=50.0,
                        kv_start=mx.array([0, 37], mx.int32), backend=backend))
                # Attention sinks (SINKS, gpt-oss): causal with a window.
                run(f"{dn} attention D={D} mask=causal window=33 cap=None kv=None sinks",
                    lambda: attention.flash_attention(
                        q, kv, kv, scale=0.1, mask="causal", window=33, sinks=arr((4,), dt),
                        backend=backend))
                # Decode: one row and the largest row tile, causal, Q8_0 K/V.
                for Lq, heads in ((1, (4, 4)), (8, (8, 1))):
                    for q8 in ((None, "q8_0") if D % 32 == 0 else (None,)):
                        run(f"{dn} decode D={D} Lq={Lq} heads={heads} kv={q8}",
                            lambda: decode.decode_attention(
                                arr((1, heads[0], Lq, D), dt), arr((1, heads[1], 70, D), dt),
                                arr((1, heads[1], 70, D), dt), scale=0.1, mask="causal",
                                kv_quant=q8, backend=backend))
            # Dequantize: every affine format to this dtype, an aligned and a ragged row.
            for fmt in formats:
                for n, k in ((64, 256), (5, 96 if fmt[1] == 32 else 128 * 3)):
                    q = weight(n, k, dt, fmt)
                    run(f"{dn} dequantize weight={fmt_name(fmt)} n={n} k={k}",
                        lambda: dequantize.dequantize(q.w, q.scales, q.biases,
                                                      group_size=q.group_size, bits=q.bits,
                                                      dtype=dt, backend=backend))
            # MoE: every tile with the four gated activations and biases, and gate-less experts
            # (moe_up); quantized experts, mixed formats; the combine.
            E, idx = 8, mx.array([[0, 3], [3, 7], [1, 0]], dtype=mx.int32)
            for tile in moe_msl.TILES:
                run(f"{dn} moe tile={tile} activation=relu2 (gate-less)",
                    lambda: moe.moe_mlp(arr((3, 64), dt), idx, None, arr((E, 96, 64), dt),
                                        arr((E, 64, 96), dt), b_up=arr((E, 96), dt),
                                        b_down=arr((E, 64), dt), activation="relu2", tile=tile,
                                        check_indices=False, backend=backend))
                for act in ("silu", "gelu_tanh", "swiglu_oai", "situ"):
                    run(f"{dn} moe tile={tile} activation={act}",
                        lambda: moe.moe_mlp(arr((3, 64), dt), idx, arr((E, 96, 64), dt),
                                            arr((E, 96, 64), dt), arr((E, 64, 96), dt),
                                            b_gate=arr((E, 96), dt), b_up=arr((E, 96), dt),
                                            b_down=arr((E, 64), dt), activation=act, tile=tile,
                                            check_indices=False, backend=backend))
            for fmt in formats:
                def experts(n, k, fmt=fmt):
                    w, sc, b = mx.quantize(mx.ones((E, n, k), dt), group_size=fmt[1],
                                           bits=fmt[0])
                    return QuantizedWeight(w, sc, b, fmt[1], fmt[0])

                run(f"{dn} moe gate-less weight={fmt_name(fmt)}",
                    lambda: moe.moe_mlp(arr((3, 256), dt), idx, None, experts(128, 256),
                                        experts(256, 128), activation="relu2",
                                        check_indices=False, backend=backend))
                run(f"{dn} moe weight={fmt_name(fmt)}/float",
                    lambda: moe.moe_mlp_combine(arr((3, 256), dt), idx, arr((3, 2), dt),
                                                experts(128, 256), arr((E, 128, 256), dt),
                                                experts(256, 128), check_indices=False,
                                                backend=backend))
            # Gated DeltaNet: a chunk tail (T = 40), GQA (2 key / 4 value heads), a state
            run(f"{dn} gated_delta",
                lambda: gdn.gated_delta(arr((1, 40, 2, 64), dt), arr((1, 40, 2, 64), dt),
                                        arr((1, 40, 4, 32), dt), -mx.ones((1, 40, 4), dt),
                                        0.5 * mx.ones((1, 40, 4), dt),
                                        mx.zeros((1, 4, 32, 64), mx.float32), backend=backend))
            run(f"{dn} gated_delta per key dim",  # Kimi Delta Attention: the VEC kernel
                lambda: gdn.gated_delta(arr((1, 40, 2, 64), dt), arr((1, 40, 2, 64), dt),
                                        arr((1, 40, 2, 32), dt), mx.ones((1, 40, 2, 64), dt),
                                        0.5 * mx.ones((1, 40, 2), dt), backend=backend))
            # SSD: a chunk tail (T = 40), 2 groups of 2 heads of 16 (8-column blocks too), a
            # state; short conv: LFM2's gated 3 taps and a Mamba-2 conv (bias, SiLU, 4 taps)
            for P in (16, 24):
                run(f"{dn} ssd P={P}",
                    lambda P=P: ssd.ssd(arr((1, 40, 4, P), dt), arr((1, 40, 4), dt),
                                        mx.zeros((4,)), arr((1, 40, 2, 32), dt),
                                        arr((1, 40, 2, 32), dt), mx.ones((4,), dt),
                                        state=mx.zeros((1, 4, P, 32)), backend=backend))
            run(f"{dn} short_conv gates",
                lambda: short_conv.short_conv(arr((1, 40, 64), dt), arr((64, 3, 1), dt),
                                              gate_in=arr((1, 40, 64), dt),
                                              gate_out=arr((1, 40, 64), dt), backend=backend))
            run(f"{dn} short_conv silu",
                lambda: short_conv.short_conv(arr((1, 40, 64), dt), arr((64, 4, 1), dt),
                                              arr((64,), dt), mask=mx.ones((1, 40), mx.bool_),
                                              activation="silu", backend=backend))
            # Mamba-1's selective scan: 8, 4 and 1 lanes per channel (N = 16, 12, 5), channels
            # not filling a threadgroup, a state
            for N in (16, 12, 5):
                run(f"{dn} selective_scan N={N}",
                    lambda N=N: selective_scan.selective_scan(
                        arr((1, 40, 48), dt), arr((1, 40, 48), dt), mx.zeros((48, N)),
                        arr((1, 40, N), dt), arr((1, 40, N), dt), mx.ones((48,), dt),
                        state=mx.zeros((1, 48, N)), backend=backend))
            run(f"{dn} q8_0",
                lambda: q8_0.dequantize_q8_0(*q8_0.quantize_q8_0(arr((4, 64), dt),
                                                                 backend=backend),
                                             dtype=dt, backend=backend))
    return out


def generated(record: tuple):
    """The kernel MLX generates for one recorded launch (``emulator.source.Generated``)."""
    from mlx_bricks import kernels
    from mlx_bricks.emulator import source as S

    name, inputs, output_dtypes, template, _ = record
    spec = kernels.spec(name)
    kname, header, body = kernels.kernel_source(name, "metal")
    infos = [S.InputInfo(x.dtype, x.ndim, x.size) for x in inputs]
    return S.generate(kname, list(spec.input_names), list(spec.output_names), body, header,
                      infos, output_dtypes, template, spec.atomic_outputs)


def launches(backend: str | None = None) -> list[tuple[str, tuple]]:
    """(case, record) of every MSL launch the ops make in the configurations of
    :func:`instantiations` (records as :func:`recorded_msl_launches` yields them)."""
    from mlx_bricks.backends import BackendError, backend_status

    if backend is None:
        backend = next((b for b in ("metal", "emulator") if backend_status(b)), None)
        if backend is None:
            raise BackendError("neither metal nor emulator is available to drive the ops")
    return _drive_ops(backend)
