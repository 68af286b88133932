"""Gated DeltaNet benchmarks: the recurrence of one layer (mlx-lm's ``gated_delta_update``
recurrence vs the brick's ``gated_delta``, same inputs) and a 4-layer Qwen3.5-shaped model's
prefill (stock mlx-lm vs ``patch_model(tune='auto')``, same weights).

Shapes: Qwen3.5-35B-A3B's Gated DeltaNet (16 key / 32 value heads of 128) at 512 / 2,048 /
8,192 / 32,768 tokens, bf16, on a kernel backend; its 4-layer model (3 Gated DeltaNet layers,
1 attention layer, MoE MLPs: 256 experts of 512, top-8, shared expert 512; a 32000-token
vocabulary); on the CPU (no kernel backend) a small Qwen3.5-shaped model (hidden 512, the same
Gated DeltaNet heads, a dense MLP) at 512 tokens, and the recurrence at 512.
"""
from __future__ import annotations

from dataclasses import dataclass

#: Prompt lengths of the GPU cases.
T_VALUES = (512, 2048, 8192, 32768)
#: Prompt lengths of the CPU cases (stock's token loop takes seconds per layer at 512).
CPU_T_VALUES = (512,)


@dataclass(frozen=True)
class Qwen35Shape:
    """A qwen3_5 (dense) or qwen3_5_moe model's shape (mlx-lm ``TextModelArgs`` fields): every
    ``full_attention_interval``-th layer attention, the others Gated DeltaNet."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    k_heads: int
    v_heads: int
    gdn_dim: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0

    def describe(self) -> str:
        mlp = (f"{self.experts} experts of {self.moe_intermediate}, top-{self.top_k}, shared "
               f"{self.shared_intermediate}" if self.experts else
               f"intermediate {self.intermediate}")
        return (f"hidden {self.hidden}, Gated DeltaNet {self.k_heads}/{self.v_heads} heads of "
                f"{self.gdn_dim}, attention {self.heads}/{self.kv_heads} heads of "
                f"{self.head_dim} every 4th layer, {mlp}, vocab {self.vocab}")

    def model_class(self):
        from mlx_lm.models.qwen3_5 import Model

        return Model

    def model_args(self):
        from mlx_lm.models.qwen3_5 import ModelArgs

        model_type = "qwen3_5_moe" if self.experts else "qwen3_5"
        text = dict(model_type=model_type, hidden_size=self.hidden,
                    intermediate_size=self.intermediate, num_hidden_layers=self.layers,
                    num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                    head_dim=self.head_dim, linear_num_key_heads=self.k_heads,
                    linear_num_value_heads=self.v_heads, linear_key_head_dim=self.gdn_dim,
                    linear_value_head_dim=self.gdn_dim, vocab_size=self.vocab,
                    full_attention_interval=4, rms_norm_eps=1e-6, tie_word_embeddings=False,
                    num_experts=self.experts, num_experts_per_tok=self.top_k,
                    moe_intermediate_size=self.moe_intermediate,
                    shared_expert_intermediate_size=self.shared_intermediate)
        return ModelArgs.from_dict({"model_type": model_type, "text_config": text})


#: Qwen3.5-35B-A3B's layer shapes, 4 layers (3 Gated DeltaNet + 1 attention).
QWEN35_35B_4LAYER = Qwen35Shape(hidden=2048, intermediate=512, layers=4, heads=16, kv_heads=2,
                                head_dim=256, k_heads=16, v_heads=32, gdn_dim=128, vocab=32000,
                                experts=256, top_k=8, moe_intermediate=512,
                                shared_intermediate=512)
#: The CPU target's model (issue 36): hidden 512, 16/32 Gated DeltaNet heads of 128.
QWEN35_SMALL_4LAYER = Qwen35Shape(hidden=512, intermediate=1536, layers=4, heads=4,
                                  kv_heads=2, head_dim=128, k_heads=16, v_heads=32,
                                  gdn_dim=128, vocab=8192)


def recurrence_inputs(T: int, dtype="bf16", *, B: int = 1, Hk: int = 16, Hv: int = 32,
                      D: int = 128, seed: int = 0) -> dict:
    """Model-like inputs of one layer's recurrence (the tuner kind's synthetic values)."""
    import mlx.core as mx

    from mlx_bricks.bench.e2e import mx_dtype
    from mlx_bricks.bricks.gated_delta.kind import GATED_DELTA
    from mlx_bricks.runtime.kind import Act

    dt = mx_dtype(dtype)
    args = {"q": Act((B, T, Hk, D), dt), "k": Act((B, T, Hk, D), dt),
            "v": Act((B, T, Hv, D), dt), "g": Act((B, T, Hv), mx.float32),
            "beta": Act((B, T, Hv), dt), "state": Act((B, Hv, D, D), mx.float32)}
    args = GATED_DELTA.synthetic(args, seed)
    mx.eval(list(args.values()))
    return args


def recurrence(T: int, dtype="bf16"):
    """``(brick, stock, info)``: the brick's ``gated_delta`` (auto backend) vs mlx-lm's
    recurrence (``gated_delta_stock``) on the same inputs."""
    from mlx_bricks.backends import active_backend
    from mlx_bricks.bricks.gated_delta.op import gated_delta, gated_delta_stock

    args = recurrence_inputs(T, dtype)
    backend = active_backend(None).name

    def info():
        return {"T": T, "dtype": dtype, "backend": backend, "heads": "16/32", "dim": 128}

    return (lambda: gated_delta(**args, backend=backend)[0],
            lambda: gated_delta_stock(**args)[0], info)


def benchmarks() -> dict:
    """The Gated DeltaNet benchmarks by name, for ``bench.core``."""
    from mlx_bricks.bench.case import CPU, KERNEL, Benchmark
    from mlx_bricks.bench.e2e import setup

    table = {}
    for T in T_VALUES:
        name = f"gdn_recurrence_bf16_t{T}"
        table[name] = Benchmark(
            name, KERNEL,
            f"Gated DeltaNet recurrence of one Qwen3.5-35B-A3B-shaped layer (16/32 heads of "
            f"128), T={T} tokens, bf16, float32 state: mlx-lm's gated_delta_update recurrence "
            "vs the gated_delta brick", lambda T=T: recurrence(T))
        name = f"e2e_qwen35_35b_4layer_bf16_t{T}"
        table[name] = Benchmark(
            name, KERNEL,
            f"full-model prefill, T={T} tokens, bf16: Qwen3.5-35B-A3B-shaped qwen3_5_moe, 4 "
            f"layers ({QWEN35_35B_4LAYER.describe()}), random weights; stock mlx-lm vs "
            "patch_model(tune='auto')", lambda T=T: setup(QWEN35_35B_4LAYER, "bf16", T))
    for T in CPU_T_VALUES:
        name = f"gdn_recurrence_cpu_bf16_t{T}"
        table[name] = Benchmark(
            name, CPU,
            f"Gated DeltaNet recurrence on the CPU, T={T}, bf16, 16/32 heads of 128: mlx-lm's "
            "token loop vs the brick's chunked composite", lambda T=T: recurrence(T))
        name = f"e2e_qwen35_small_cpu_bf16_t{T}"
        table[name] = Benchmark(
            name, CPU,
            f"full-model prefill on the CPU, T={T} tokens, bf16: small Qwen3.5-shaped qwen3_5 "
            f"({QWEN35_SMALL_4LAYER.describe()}), random weights; stock mlx-lm vs "
            "patch_model(tune='auto') with no kernel backend (the chunked composite)",
            lambda T=T: setup(QWEN35_SMALL_4LAYER, "bf16", T))
    return table
