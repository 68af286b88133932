"""State-space and short-conv benchmarks (issue 42): the SSD scan, Mamba-1's selective scan and
the short convolution of
one layer (mlx-lm's ops vs the bricks, same inputs), 4-layer real-shaped prefills (stock mlx-lm
vs ``patch_model(tune='auto')``, same weights) and their decode (stock vs patched: the decode
gate keeps mlx-lm's own step).

Shapes: Jamba's Mamba-1 layers (hidden 4096, 8192 channels, N = 16; an attention layer, dense
SwiGLU MLPs of 14336) and Falcon-Mamba-7B's (hidden 4096, 4 Mamba-1 layers);
Nemotron-3-Nano-30B-A3B's Mamba-2 layers (hidden 2688; 64 heads of 64, 8 groups,
N = 128, 4 conv taps), four of them; LFM2-1.2B's layers (hidden 2048, 3-tap short convs, an
attention layer of 32/8 heads of 64, SwiGLU MLPs of 8192), four of them (3 conv + 1 attention);
at 2,048 and 8,192 tokens, bf16, on a kernel backend. On the CPU (no kernel backend) small
models of the same mixer shapes (hidden 512) at 512 tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: Prompt lengths of the GPU cases and of the CPU cases.
T_VALUES = (2048, 8192)
CPU_T_VALUES = (512,)
#: Decode steps timed per call (after a 512-token prefill).
DECODE_STEPS = 16


@dataclass(frozen=True)
class NemotronHShape:
    """A nemotron_h model of Mamba-2 layers and one attention layer (``pattern``; mlx-lm's
    nemotron_h needs one), Nemotron-3-Nano's mixers."""

    hidden: int
    layers: int = 4
    heads: int = 64
    head_dim: int = 64
    groups: int = 8
    state: int = 128
    vocab: int = 32000
    pattern: str = "MM*M"

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.layers} layers {self.pattern}, Mamba-2 "
                f"{self.heads} heads of {self.head_dim}, {self.groups} groups, N {self.state},"
                f" vocab {self.vocab}")

    def model_class(self):
        from mlx_lm.models.nemotron_h import Model

        return Model

    def model_args(self):
        from mlx_lm.models.nemotron_h import ModelArgs

        return ModelArgs(model_type="nemotron_h", vocab_size=self.vocab,
                         hidden_size=self.hidden, intermediate_size=4 * self.hidden,
                         max_position_embeddings=262144, num_attention_heads=32,
                         num_key_value_heads=2, head_dim=128, attention_bias=False,
                         mamba_num_heads=self.heads, mamba_head_dim=self.head_dim,
                         mamba_proj_bias=False, ssm_state_size=self.state, conv_kernel=4,
                         n_groups=self.groups, mlp_bias=False, layer_norm_epsilon=1e-5,
                         use_bias=False, use_conv_bias=True,
                         hybrid_override_pattern=list(self.pattern),
                         time_step_limit=(0.0, float("inf")))


@dataclass(frozen=True)
class Lfm2Shape:
    """An lfm2 model: short-conv layers and attention layers (``layer_types``)."""

    hidden: int
    ff: int
    heads: int = 32
    kv_heads: int = 8
    vocab: int = 65536
    layer_types: tuple = field(default=("conv", "conv", "full_attention", "conv"))

    def describe(self) -> str:
        return (f"hidden {self.hidden}, layers {'/'.join(self.layer_types)} (3-tap short "
                f"convs, attention {self.heads}/{self.kv_heads} heads), SwiGLU {self.ff}, "
                f"vocab {self.vocab}")

    def model_class(self):
        from mlx_lm.models.lfm2 import Model

        return Model

    def model_args(self):
        from mlx_lm.models.lfm2 import ModelArgs

        return ModelArgs(model_type="lfm2", vocab_size=self.vocab, hidden_size=self.hidden,
                         num_hidden_layers=len(self.layer_types), num_attention_heads=self.heads,
                         num_key_value_heads=self.kv_heads, max_position_embeddings=128000,
                         norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=self.hidden,
                         block_multiple_of=256, block_ffn_dim_multiplier=1.0,
                         block_auto_adjust_ff_dim=False, block_ff_dim=self.ff,
                         layer_types=list(self.layer_types))


@dataclass(frozen=True)
class JambaShape:
    """A jamba model of Mamba-1 layers and one attention layer (layer 2), dense SwiGLU MLPs
    (``experts`` 1; Jamba's MoE blocks are the MoE brick's, benchmarked apart), Jamba's mixers:
    ``expand`` x hidden channels, N 16, 4 conv taps, time-step rank hidden / 16."""

    hidden: int
    ff: int
    layers: int = 4
    state: int = 16
    expand: int = 2
    vocab: int = 65536

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.layers} layers (attention at 2, Mamba-1 "
                f"{self.expand * self.hidden} channels, N {self.state}), SwiGLU {self.ff}, "
                f"vocab {self.vocab}")

    def model_class(self):
        from mlx_lm.models.jamba import Model

        return Model

    def model_args(self):
        from mlx_lm.models.jamba import ModelArgs

        return ModelArgs(model_type="jamba", hidden_size=self.hidden, intermediate_size=self.ff,
                         num_hidden_layers=self.layers, num_attention_heads=32,
                         num_key_value_heads=8, attn_layer_offset=2, attn_layer_period=4,
                         expert_layer_offset=1, expert_layer_period=2, mamba_d_conv=4,
                         mamba_d_state=self.state, mamba_expand=self.expand, num_experts=1,
                         num_experts_per_tok=1, rms_norm_eps=1e-6,
                         max_position_embeddings=262144, vocab_size=self.vocab,
                         tie_word_embeddings=False)


@dataclass(frozen=True)
class MambaShape:
    """A mamba model (Mamba-1 layers only); ``bcdt_rms``: Falcon-Mamba's weightless RMS norms
    of the time steps, B and C."""

    hidden: int
    layers: int = 4
    state: int = 16
    vocab: int = 65024
    bcdt_rms: bool = True

    def describe(self) -> str:
        return (f"hidden {self.hidden}, {self.layers} Mamba-1 layers of {2 * self.hidden} "
                f"channels, N {self.state}, B/C/dt RMS norms {self.bcdt_rms}, vocab {self.vocab}")

    def model_class(self):
        from mlx_lm.models.mamba import Model

        return Model

    def model_args(self):
        from mlx_lm.models.mamba import ModelArgs

        return ModelArgs(model_type="falcon_mamba" if self.bcdt_rms else "mamba",
                         vocab_size=self.vocab, hidden_size=self.hidden,
                         intermediate_size=2 * self.hidden, state_size=self.state,
                         num_hidden_layers=self.layers, conv_kernel=4, use_bias=False,
                         use_conv_bias=True, time_step_rank=-(-self.hidden // 16),
                         use_bcdt_rms=self.bcdt_rms)


NEMOTRON3_4LAYER = NemotronHShape(hidden=2688)
#: Jamba-v0.1 / Jamba-1.5-Mini's dimensions; Falcon-Mamba-7B's.
JAMBA_4LAYER = JambaShape(hidden=4096, ff=14336)
FALCON_MAMBA_4LAYER = MambaShape(hidden=4096)
JAMBA_SMALL = JambaShape(hidden=512, ff=1536, vocab=8192)
LFM2_1B_4LAYER = Lfm2Shape(hidden=2048, ff=8192)
NEMOTRON3_SMALL = NemotronHShape(hidden=512, vocab=8192)
LFM2_SMALL = Lfm2Shape(hidden=512, ff=1536, heads=8, kv_heads=2, vocab=8192)


def _kind_case(kind, placeholders: dict, T: int, dtype: str, **shape):
    """``(brick, stock, info)``: op kind ``kind`` (auto backend) vs its stock on one layer's
    model-like inputs (the kind's synthetic values for ``placeholders``), y compared; ``info``
    records T, the dtype, the backend and ``shape``."""
    import mlx.core as mx

    from mlx_bricks.backends import active_backend

    args = kind.synthetic(placeholders)
    mx.eval(list(v for v in args.values() if isinstance(v, mx.array)))
    backend = active_backend(None).name

    def info():
        return {"T": T, "dtype": dtype, "backend": backend, **shape}

    return (lambda: kind.brick(args, backend)[0], lambda: kind.stock(args)[0], info)


def scan(T: int, dtype="bf16", shape: NemotronHShape = NEMOTRON3_4LAYER):
    """``(brick, stock, info)``: the ``ssd`` brick (auto backend) vs mlx-lm's ``ssm_update``
    on one layer's model-like inputs (the tuner kind's synthetic values)."""
    import mlx.core as mx

    from mlx_bricks.bench.e2e import mx_dtype
    from mlx_bricks.bricks.ssd.kind import SSD_KIND
    from mlx_bricks.runtime.kind import Act

    dt = mx_dtype(dtype)
    H, P, G, N = shape.heads, shape.head_dim, shape.groups, shape.state
    return _kind_case(SSD_KIND, {
        "x": Act((1, T, H, P), dt), "dt": Act((1, T, H), dt), "A_log": Act((H,), mx.float32),
        "B": Act((1, T, G, N), dt), "C": Act((1, T, G, N), dt), "D": Act((H,), dt),
        "dt_bias": Act((H,), dt), "time_step_limit": (0.0, float("inf"))}, T, dtype,
        H=H, P=P, G=G, N=N)


def selective(T: int, dtype="bf16", channels: int = 8192, N: int = 16):
    """``(brick, stock, info)``: the ``selective_scan`` brick (auto backend) vs mlx-lm's token
    loop (jamba's ``ssm_step`` from the conv output on) on one Jamba-shaped layer's model-like
    inputs (the tuner kind's synthetic values)."""
    import mlx.core as mx

    from mlx_bricks.bench.e2e import mx_dtype
    from mlx_bricks.bricks.selective_scan.kind import SELECTIVE_SCAN_KIND
    from mlx_bricks.runtime.kind import Act

    dt = mx_dtype(dtype)
    act = Act((1, T, channels), dt)
    return _kind_case(SELECTIVE_SCAN_KIND, {
        "x": act, "dt": act, "A_log": Act((channels, N), mx.float32),
        "B": Act((1, T, N), dt), "C": Act((1, T, N), dt), "D": Act((channels,), dt)}, T, dtype,
        channels=channels, N=N)


def conv(T: int, dtype="bf16", channels: int = 2048):
    """``(brick, stock, info)``: the ``short_conv`` brick vs mlx-lm's ops on LFM2's conv
    (B * x, 3 taps from a state, C * y)."""
    import mlx.core as mx

    from mlx_bricks.bench.e2e import mx_dtype
    from mlx_bricks.bricks.short_conv.kind import SHORT_CONV
    from mlx_bricks.runtime.kind import Act

    dt = mx_dtype(dtype)
    act = Act((1, T, channels), dt)
    return _kind_case(SHORT_CONV, {
        "x": act, "gate_in": act, "gate_out": act, "state": Act((1, 2, channels), dt),
        "weight": mx.random.normal((channels, 3, 1), key=mx.random.key(3)).astype(dt)}, T, dtype,
        channels=channels, K=3)


def decode(shape, dtype="bf16", prompt: int = 512, steps: int = DECODE_STEPS):
    """``(patched, stock, info)``: ``steps`` one-token forwards continuing a ``prompt``-token
    prefill, patched model vs stock (same weights; each side's cache grows as it is timed)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_bricks.bench.e2e import _models
    from mlx_bricks.patch import patch_model

    stock, patched = _models(shape, dtype)
    report = patch_model(patched, tune="auto")
    toks = mx.random.randint(0, shape.vocab, (1, prompt), key=mx.random.key(prompt))
    caches = {}
    for name, model in (("stock", stock), ("patched", patched)):
        caches[name] = make_prompt_cache(model)
        mx.eval(model(toks, cache=caches[name]))
    step = toks[:, -1:]

    def run(name, model):
        y = None
        for _ in range(steps):
            y = model(step, cache=caches[name])
            mx.eval(y)
        return y

    def info():
        return {"model": {"shape": shape.__dict__, "dtype": dtype, "prompt": prompt,
                          "steps": steps},
                "patch": {"backend": report.backend.name, "n_patched": report.n_patched,
                          "stock_calls": dict(report.stock_calls())}}

    return (lambda: run("patched", patched), lambda: run("stock", stock), info)


def benchmarks() -> dict:
    """The state-space and short-conv benchmarks by name, for ``bench.core``."""
    from mlx_bricks.bench.core import CPU, KERNEL, Benchmark
    from mlx_bricks.bench.e2e import setup

    table = {}
    models = (("nemotron3_4layer", NEMOTRON3_4LAYER, "Nemotron-3-Nano-shaped nemotron_h"),
              ("lfm2_1b_4layer", LFM2_1B_4LAYER, "LFM2-1.2B-shaped lfm2"),
              ("jamba_4layer", JAMBA_4LAYER, "Jamba-shaped jamba (dense MLPs)"),
              ("falcon_mamba_4layer", FALCON_MAMBA_4LAYER, "Falcon-Mamba-7B-shaped mamba"))
    for T in T_VALUES:
        table[f"ssd_scan_bf16_t{T}"] = Benchmark(
            f"ssd_scan_bf16_t{T}", KERNEL,
            f"SSD scan of one Nemotron-3-Nano-shaped Mamba-2 layer (64 heads of 64, 8 groups, "
            f"N=128), T={T}, bf16: mlx-lm's ssm_update (ssm_attn) vs the ssd brick",
            lambda T=T: scan(T))
        table[f"selective_scan_bf16_t{T}"] = Benchmark(
            f"selective_scan_bf16_t{T}", KERNEL,
            f"Mamba-1 selective scan of one Jamba-shaped layer (8192 channels, N=16), T={T}, "
            "bf16: mlx-lm's token loop (jamba's ssm_step) vs the selective_scan brick",
            lambda T=T: selective(T))
        table[f"short_conv_bf16_t{T}"] = Benchmark(
            f"short_conv_bf16_t{T}", KERNEL,
            f"LFM2-1.2B's short conv (2048 channels, 3 taps, B/C gates, a state), T={T}, bf16:"
            " mlx-lm's ops (grouped conv1d) vs the short_conv brick", lambda T=T: conv(T))
        for name, shape, what in models:
            table[f"e2e_{name}_bf16_t{T}"] = Benchmark(
                f"e2e_{name}_bf16_t{T}", KERNEL,
                f"full-model prefill, T={T} tokens, bf16: {what}, {shape.describe()}, random "
                "weights; stock mlx-lm vs patch_model(tune='auto')",
                lambda shape=shape, T=T: setup(shape, "bf16", T))
            table[f"e2e_{name}_bf16_q4g64_t{T}"] = Benchmark(
                f"e2e_{name}_bf16_q4g64_t{T}", KERNEL,
                "the same with the decoder layers' linears 4-bit gs64 (MLX affine) on both "
                "sides, as mlx-community's 4-bit checkpoints",
                lambda shape=shape, T=T: setup(shape, "bf16", T, fmt=(4, 64)))
    for name, shape, what in models:
        table[f"decode_{name}_bf16"] = Benchmark(
            f"decode_{name}_bf16", KERNEL,
            f"decode, {DECODE_STEPS} tokens after a 512-token prefill, bf16: {what}; stock vs "
            "patched (decode runs mlx-lm's own step behind the decode gate)",
            lambda shape=shape: decode(shape))
    cpu_models = (("nemotron3_small", NEMOTRON3_SMALL, "small Nemotron-3-Nano-mixer-shaped "
                   "nemotron_h"), ("lfm2_small", LFM2_SMALL, "small LFM2-shaped lfm2"),
                  ("jamba_small", JAMBA_SMALL, "small Jamba-shaped jamba"))
    for T in CPU_T_VALUES:
        table[f"selective_scan_cpu_bf16_t{T}"] = Benchmark(
            f"selective_scan_cpu_bf16_t{T}", CPU,
            f"Mamba-1 selective scan on the CPU, T={T}, bf16, 1024 channels, N=16: mlx-lm's "
            "token loop vs the brick's chunked composite",
            lambda T=T: selective(T, channels=1024))
        table[f"ssd_scan_cpu_bf16_t{T}"] = Benchmark(
            f"ssd_scan_cpu_bf16_t{T}", CPU,
            f"SSD scan on the CPU, T={T}, bf16, 64 heads of 64, 8 groups, N=128: mlx-lm's "
            "ssm_attn vs the brick's chunked composite", lambda T=T: scan(T))
        for name, shape, what in cpu_models:
            table[f"e2e_{name}_cpu_bf16_t{T}"] = Benchmark(
                f"e2e_{name}_cpu_bf16_t{T}", CPU,
                f"full-model prefill on the CPU, T={T} tokens, bf16: {what} "
                f"({shape.describe()}), random weights; stock mlx-lm vs "
                "patch_model(tune='auto') with no kernel backend (the composites)",
                lambda shape=shape, T=T: setup(shape, "bf16", T))
    return table
