"""Multi-head latent attention benchmarks: a DeepSeek-V3-shaped 4-layer model's prefill and
decode (stock mlx-lm vs ``patch_model(tune='auto')``, same weights), and on the CPU a small
DeepSeek-shaped model with 4-bit weights (the quantized pieces' composites against stock).

Shapes: DeepSeek-V3's layers (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, query head
128 + 64, value head 128; layer 0 dense with intermediate 18432, layers 1-3 MoE of 2048-wide
experts, top-8, one shared expert) with 64 routed experts instead of 256 (the same FLOPs a token:
top-8 either way; 256 would be 68 GB of bf16 experts for 3 layers) and a 32000-token vocabulary,
bf16, prompts of 2,048 and 8,192 tokens. Decode: one token after a prefill of 2,048 (the cache
trimmed back after each timed step, so every step sees the same length).

The lead's GPU command (H100 / H200, one process)::

    python -m mlx_bricks.bench --only e2e_deepseek_v3_4layer --repeats 10 \\
        --out bench/results/h100-e2e-deepseek-v3.json
"""
from __future__ import annotations

from dataclasses import dataclass

#: Prompt lengths of the GPU prefill cases.
T_VALUES = (2048, 8192)
#: Cached tokens of the decode case.
DECODE_CONTEXT = 2048


@dataclass(frozen=True)
class DeepseekV3Shape:
    """A deepseek_v3 model's shape (mlx-lm ``ModelArgs`` fields)."""

    hidden: int
    layers: int
    heads: int
    q_lora: int
    kv_lora: int
    intermediate: int
    experts: int
    top_k: int
    moe_intermediate: int
    vocab: int
    nope: int = 128
    rope: int = 64
    v: int = 128
    groups: int = 8

    def describe(self) -> str:
        return (f"hidden {self.hidden}, MLA {self.heads} heads of {self.nope}+{self.rope}/"
                f"{self.v}, q_lora {self.q_lora}, kv_lora {self.kv_lora}, layer 0 dense "
                f"({self.intermediate}), then {self.experts} experts of {self.moe_intermediate}"
                f", top-{self.top_k}, 1 shared, vocab {self.vocab}")

    def model_class(self):
        from mlx_lm.models.deepseek_v3 import Model

        return Model

    def model_args(self):
        from mlx_lm.models.deepseek_v3 import ModelArgs

        return ModelArgs(
            model_type="deepseek_v3", vocab_size=self.vocab, hidden_size=self.hidden,
            intermediate_size=self.intermediate, moe_intermediate_size=self.moe_intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.heads, n_shared_experts=1, n_routed_experts=self.experts,
            routed_scaling_factor=2.5, kv_lora_rank=self.kv_lora, q_lora_rank=self.q_lora,
            qk_rope_head_dim=self.rope, v_head_dim=self.v, qk_nope_head_dim=self.nope,
            n_group=self.groups, topk_group=min(4, self.groups),
            num_experts_per_tok=self.top_k, first_k_dense_replace=1,
            max_position_embeddings=163840,
            rope_scaling={"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                          "beta_fast": 32, "beta_slow": 1,
                          "original_max_position_embeddings": 4096})


#: DeepSeek-V3's layer shapes, 4 layers (64 routed experts: module docstring).
DEEPSEEK_V3_4LAYER = DeepseekV3Shape(hidden=7168, layers=4, heads=128, q_lora=1536,
                                     kv_lora=512, intermediate=18432, experts=64, top_k=8,
                                     moe_intermediate=2048, vocab=32000)
#: A small DeepSeek-shaped model for the CPU (DeepSeek-V3's head widths and ranks).
SMALL_DEEPSEEK = DeepseekV3Shape(hidden=512, layers=2, heads=4, q_lora=256, kv_lora=512,
                                 intermediate=1024, experts=8, top_k=2, moe_intermediate=256,
                                 vocab=8192, groups=1)


def decode(shape, dtype: str, context: int):
    """``(patched step, stock step, info)``: one decode token after ``context`` cached ones,
    the cache trimmed back after each step (same weights on both sides)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_bricks.bench.e2e import _models
    from mlx_bricks.patch import patch_model

    stock, patched = _models(shape, dtype)
    report = patch_model(patched, tune="auto")
    prompt = mx.random.randint(0, shape.vocab, (1, context), key=mx.random.key(context))
    token = prompt[:, -1:]
    caches = {}
    for name, model in (("patched", patched), ("stock", stock)):
        caches[name] = make_prompt_cache(model)
        mx.eval(model(prompt, cache=caches[name]))

    def step(model, cache):
        out = model(token, cache=cache)
        mx.eval(out)
        for c in cache:
            c.trim(1)
        return out

    def info():
        return {"model": {"shape": shape.__dict__, "dtype": dtype, "context": context},
                "patch": {"backend": report.backend.name, "n_patched": report.n_patched,
                          "stock_calls": dict(report.stock_calls())}}

    return (lambda: step(patched, caches["patched"]), lambda: step(stock, caches["stock"]),
            info)


def benchmarks() -> dict:
    """The MLA benchmarks by name, for ``bench.core``."""
    from mlx_bricks.bench.core import CPU, KERNEL, Benchmark
    from mlx_bricks.bench.e2e import setup

    table = {}
    for T in T_VALUES:
        name = f"e2e_deepseek_v3_4layer_bf16_t{T}"
        table[name] = Benchmark(
            name, KERNEL,
            f"full-model prefill, T={T} tokens, bf16: DeepSeek-V3-shaped deepseek_v3, 4 layers "
            f"({DEEPSEEK_V3_4LAYER.describe()}), random weights; stock mlx-lm vs "
            "patch_model(tune='auto')", lambda T=T: setup(DEEPSEEK_V3_4LAYER, "bf16", T))
    name = f"e2e_deepseek_v3_4layer_bf16_decode_s{DECODE_CONTEXT}"
    table[name] = Benchmark(
        name, KERNEL,
        f"one decode token over {DECODE_CONTEXT} cached, bf16, the DeepSeek-V3-shaped 4-layer "
        "model: stock mlx-lm vs the patched model (decode is stock by design: the ratio is "
        "the decode gate's cost)", lambda: decode(DEEPSEEK_V3_4LAYER, "bf16", DECODE_CONTEXT))
    name = "e2e_small_deepseek_cpu_q4g64_bf16_t512"
    table[name] = Benchmark(
        name, CPU,
        f"full-model prefill on the CPU, T=512, bf16 activations, affine 4-bit gs64 weights: "
        f"small DeepSeek-shaped deepseek_v3 ({SMALL_DEEPSEEK.describe()}); stock mlx-lm vs "
        "patch_model(tune='auto') with no kernel backend (the quantized pieces' composites)",
        lambda: setup(SMALL_DEEPSEEK, "bf16", 512, fmt=(4, 64)))
    return table
