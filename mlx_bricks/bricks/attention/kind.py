"""The attention brick's tuner kind: ``softmax(mask(softcap(q k^T * scale))) v`` with GQA against
``mx.fast.scaled_dot_product_attention`` (what mlx-lm's ``scaled_dot_product_attention`` runs
for a ``KVCache``). Arguments as ``ops.flash_attention`` takes them: ``q, k, v, scale, mask,
kv_quant`` and optionally ``window``, ``softcap`` (mask None or ``"causal"``, bottom-right
aligned; window None or a sliding-window length; softcap None or > 0; kv_quant None or
``"q8_0"``), and optionally ``kv_start`` (a padded batch: (B,) int32 first valid key per row,
``BatchKVCache.left_padding``; its stock is the brick's MLX reference with the same mask), and
optionally ``sinks`` ((Hq,) float attention sinks, gpt-oss: stock passes them to
``mx.fast.scaled_dot_product_attention(..., sinks=)``, as mlx-lm's attention function does).

With ``kv_quant="q8_0"`` the values are attention over the K/V's Q8_0 round trip in q's dtype,
whichever candidate runs: stock is the brick's MLX reference (the round trip in MLX ops, then
the float attention), the kernel ``default`` reads the Q8_0 blocks in its tiles,
``dequant_kv`` makes the round trip once with the q8_0 brick's kernels and runs the float
attention kernel, and the composite ``dequant_kv_sdpa`` makes the same round trip, then the
stock float attention (``mx.fast.scaled_dot_product_attention``, through the reference's
masking and soft-cap); the tuner picks by measurement, as for float K/V.

On ``cuda`` with 16-bit q/k/v (no Q8_0) of head_dim 64 / 128 / 192 / 256 the listing adds the
fast family's variants (``cuda_src/attention_fa.cu``): ``fa_wg`` (wgmma, sm_90 only) and
``fa_mma`` (mma.sync), each the first tile of its engine the GPU runs (``cuda.pick_fa_tile``).
They are candidates only: the tuner keeps stock (cuDNN at head_dim <= 128) wherever stock is
faster, and nothing runs them untuned (the prior keeps stock for attention)."""
from __future__ import annotations

import math

import mlx.core as mx

from mlx_bricks import kernels
from mlx_bricks.bricks.attention import cuda
from mlx_bricks.bricks.attention.op import (
    DEFAULT_VARIANT,
    flash_attention_reference,
    run_flash_attention,
    variant_names,
)
from mlx_bricks.bricks.q8_0.op import dequantize_q8_0, quantize_q8_0
from mlx_bricks.checks import dtype_name
from mlx_bricks.formats.q8_0 import kv_dense
from mlx_bricks.runtime.kind import (Composite, Key, OpKind, check_rows, flags, high_precision,
                                     register_kind)
from mlx_bricks.tune.buckets import attention_bucket

#: Options that change the values and have no stock fast path (their stock is the brick's
#: MLX-ops reference, what mlx-lm's gemma-style attention computes).
_OPTIONS = ("window", "softcap")
#: The kernel variant that attends over K/V dequantized once (``kv_quant="q8_0"`` only).
DEQUANT_KV = "dequant_kv"


def _has_q8_0_kernels(backend: str) -> bool:
    return kernels.has_kernel("q8_0_quantize", backend)


def dense_kv(x, dtype, backend: str):
    """K or V of a ``kv_quant="q8_0"`` call as the values attended over, once, in ``dtype``:
    a ``(qs, d)`` pair dequantized, a float array quantized then dequantized, with the q8_0
    brick's kernels where ``backend`` has them (else MLX ops): bit for bit
    ``formats.q8_0.kv_dense``."""
    b = backend if _has_q8_0_kernels(backend) else "reference"
    qs, d = x if isinstance(x, tuple) else quantize_q8_0(x, backend=b)
    return dequantize_q8_0(qs, d, dtype=dtype, backend=b)


def _dequant_kv_sdpa(args, backend, settings):
    q = args["q"]
    return flash_attention_reference(q, dense_kv(args["k"], q.dtype, backend),
                                     dense_kv(args["v"], q.dtype, backend),
                                     scale=args["scale"], mask=args.get("mask"),
                                     kv_start=args.get("kv_start"), sinks=args.get("sinks"),
                                     **{o: args.get(o) for o in _OPTIONS})


class Attention(OpKind):
    """The attention kind (module docstring)."""

    name = "attention"
    op_name = "flash_attention"
    activations = ("q", "k", "v")
    cuda_kernels = ("flash_attention", "flash_attention_fa")
    # On reference the round trip is MLX ops, the same graph as stock: offered where the
    # backend has the q8_0 kernels.
    composites = (Composite("dequant_kv_sdpa", _dequant_kv_sdpa,
                            lambda args, backend: bool(args.get("kv_quant"))
                            and _has_q8_0_kernels(backend)),)

    def key(self, args):
        q, k = args["q"], args["k"]
        _, Hq, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        values = dict(head_dim=D, gqa=Hq // Hkv, kv_quant=args.get("kv_quant") or "none",
                      mask=args.get("mask") or "none")
        v = args["v"][0] if isinstance(args["v"], tuple) else args["v"]
        if v.shape[3] != D:
            values["dv"] = v.shape[3]  # v narrower than q/k (multi-head latent attention)
        values.update({o: args[o] for o in _OPTIONS if args.get(o) is not None})
        if args.get("kv_start") is not None:
            values["padded"] = True  # a left-padded batch: its own decisions
        if args.get("sinks") is not None:
            values["sinks"] = True  # attention sinks: their own decisions
        return Key(self.name, flags(**values), attention_bucket(Lq, Lk), dtype_name(q.dtype),
                   "-")

    @staticmethod
    def _options(args) -> dict:
        return {o: args.get(o) for o in _OPTIONS}

    def brick(self, args, backend, kv=None, variant=None):
        q, k, v, kv_quant = args["q"], args["k"], args["v"], args.get("kv_quant")
        if kv == "dequant":  # DEQUANT_KV: the round trip once, then the float kernel
            k, v, kv_quant = dense_kv(k, q.dtype, backend), dense_kv(v, q.dtype, backend), None
        return run_flash_attention(q, k, v, scale=args["scale"], mask=args.get("mask"),
                                   kv_quant=kv_quant, kv_start=args.get("kv_start"),
                                   sinks=args.get("sinks"), backend=backend, variant=variant,
                                   **self._options(args))

    def stock(self, args):
        if (args.get("kv_quant") is not None or any(self._options(args).values())
                or args.get("kv_start") is not None):
            # Q8_0 K/V, a window, a soft-cap or a padded batch: no stock fast op with these
            # arguments; the brick's MLX-ops reference (for a padded batch: SDPA with the
            # boolean mask mlx-lm's BatchKVCache.make_mask builds).
            return flash_attention_reference(args["q"], args["k"], args["v"],
                                             scale=args["scale"], mask=args.get("mask"),
                                             kv_quant=args.get("kv_quant"),
                                             kv_start=args.get("kv_start"),
                                             sinks=args.get("sinks"), **self._options(args))
        if args.get("sinks") is not None:  # mlx-lm's attention function with sinks
            return mx.fast.scaled_dot_product_attention(args["q"], args["k"], args["v"],
                                                        scale=args["scale"],
                                                        mask=args.get("mask"),
                                                        sinks=args["sinks"])
        return mx.fast.scaled_dot_product_attention(args["q"], args["k"], args["v"],
                                                    scale=args["scale"], mask=args.get("mask"))

    def listing(self, backend, dtype, args):
        if (args is not None and args.get("kv_start") is not None
                and "kv_start" not in kernels.spec(self.op_name).inputs_for(backend)):
            return ()  # this backend's kernel has no padded-batch path: stock
        names = variant_names(backend, dtype)
        if names and args is not None and args.get("kv_quant"):
            names = (*names, DEQUANT_KV)
        if names and backend == "cuda" and args is not None and cuda.fa_applies(
                args["q"], args["k"], args["v"], args.get("kv_quant")):
            # the fast family (attention_fa.cu): its wgmma tile on sm_90, its mma.sync tile
            names = (*names, *cuda.fa_variant_names(args["q"].shape[-1], args["v"].shape[-1]))
        return names

    def variant_kwargs(self, name):
        if name == DEQUANT_KV:
            return {"kv": "dequant"}
        if name in (cuda.FA_WGMMA, cuda.FA_MMA):
            return {"variant": name}
        if name != DEFAULT_VARIANT:
            raise ValueError(f"unknown attention variant {name!r}")
        return {}  # the kernel, selected by no argument

    def n_rows(self, args):
        return args["q"].shape[2]

    def measured(self, args):
        return {"q_len": args["q"].shape[2], "kv_len": args["k"].shape[2],
                "batch": args["q"].shape[0], "heads": args["q"].shape[1]}

    def tail(self, out, rows):
        return out[:, :, -rows:, :]

    def check_stock(self, args):
        """Stock for the last query rows :meth:`tail` reads, where the mask is None or
        ``"causal"`` (bottom-right aligned: the last queries see the same keys) and stock is
        MLX's fused attention; any other call's stock runs whole."""
        if (args.get("mask") not in (None, "causal") or args.get("kv_quant") is not None
                or any(self._options(args).values()) or args.get("kv_start") is not None):
            return self.stock(args)
        rows = check_rows(self.n_rows(args))
        return self.stock(dict(args, q=args["q"][:, :, -rows:, :]))

    def reference_tail(self, args, rows):
        q, k, v = args["q"], args["k"], args["v"]
        if args.get("kv_quant") == "q8_0":
            # The values the brick attends over: Q8_0 round trip in q's dtype.
            k, v = kv_dense(k, q.dtype), kv_dense(v, q.dtype)
        Hq, Hkv, Lk = q.shape[1], k.shape[1], k.shape[2]
        with high_precision(q.dtype) as hp:
            qt = q[:, :, -rows:, :].astype(hp)
            kh = mx.repeat(k.astype(hp), Hq // Hkv, axis=1)
            vh = mx.repeat(v.astype(hp), Hq // Hkv, axis=1)
            s = (qt @ kh.transpose(0, 1, 3, 2)) * args["scale"]
            if args.get("softcap") is not None:
                s = mx.tanh(s / args["softcap"]) * args["softcap"]
            if args.get("mask") == "causal":
                # bottom-right aligned: query row r sits at position p = Lk - rows + r and sees
                # keys j <= p (and j > p - window with a sliding window)
                pos = (Lk - rows + mx.arange(rows))[:, None]
                j = mx.arange(Lk)[None, :]
                visible = j <= pos
                if args.get("window") is not None:
                    visible = visible & (j > pos - args["window"])
                s = mx.where(visible, s, mx.array(-math.inf, hp))
            if args.get("kv_start") is not None:
                # a padded batch: row b's keys j < kv_start[b] hidden; rows that see no key
                # are 0 (the brick's definition)
                first = args["kv_start"].astype(mx.int32)[:, None, None, None]
                s = mx.where(mx.arange(Lk)[None, None, None, :] >= first, s,
                             mx.array(-math.inf, hp))
                seen = mx.max(s, axis=-1, keepdims=True) != -math.inf
                s = mx.where(seen, s, mx.array(0, hp))
            if args.get("sinks") is not None:
                # one more column per head (the sink), value 0: only in the max and the sum
                sk = args["sinks"].astype(hp).reshape(1, -1, 1, 1)
                m = mx.maximum(mx.max(s, axis=-1, keepdims=True), sk)
                p = mx.exp(s - m)
                out = (p / (mx.sum(p, axis=-1, keepdims=True) + mx.exp(sk - m))) @ vh
            else:
                s = s - mx.max(s, axis=-1, keepdims=True)
                p = mx.exp(s)
                out = (p / mx.sum(p, axis=-1, keepdims=True)) @ vh
            if args.get("kv_start") is not None:
                out = mx.where(seen, out, mx.array(0, hp))
        return out


ATTENTION = register_kind(Attention())
