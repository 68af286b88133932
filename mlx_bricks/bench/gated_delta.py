"""Gated DeltaNet benchmarks: the recurrence of one layer (mlx-lm's ``gated_delta_update``
recurrence vs the brick's ``gated_delta``, same inputs) and 4-layer models' prefill (stock
mlx-lm vs ``patch_model(tune='auto')``, same weights).

Shapes: Qwen3.5-35B-A3B's Gated DeltaNet (16 key / 32 value heads of 128, a gate per head) at
512 / 2,048 / 8,192 / 32,768 tokens, bf16, on a kernel backend; its 4-layer model (3 Gated
DeltaNet layers, 1 attention layer, MoE MLPs: 256 experts of 512, top-8, shared expert 512; a
32000-token vocabulary). Kimi-Linear-48B-A3B's Kimi Delta Attention (32 heads of 128, a gate
per key dim) at 2,048 / 8,192 tokens; its 4-layer model (3 KDA layers, 1 MLA layer; 256 experts
of 1024, top-8, one shared; a 32000-token vocabulary) at 2,048 / 8,192 tokens, and its decode
step after a 2,048-token prompt. On the CPU (no kernel backend): the recurrences at 512 tokens
(the brick's side: the ``blas`` composite, the CPU's pick) and small 4-layer models (hidden
512, the same mixer heads, dense MLPs: MLX 0.32.4's CPU ``gather_mm`` takes float32 only).

The lead's GPU command (one process)::

    python -m mlx_bricks.bench --only gated_delta --repeats 5 --out bench/results/gpu-gdn.json
"""
from __future__ import annotations

from dataclasses import dataclass

#: Prompt lengths of the GPU cases.
T_VALUES = (512, 2048, 8192, 32768)
#: Prompt lengths of the CPU cases (stock's token loop takes seconds per layer at 512).
CPU_T_VALUES = (512,)
#: Prompt lengths of the Kimi-Linear GPU cases (issue 42's targets).
KDA_T_VALUES = (2048, 8192)


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



@dataclass(frozen=True)
class KimiLinearShape:
    """A kimi_linear model's shape (mlx-lm ``ModelArgs`` fields): layers 1 .. layers - 1 Kimi
    Delta Attention, the last MLA; layer 0 a dense MLP, the others MoE (``experts`` > 0)."""

    hidden: int
    intermediate: int
    layers: int
    kda_heads: int
    kda_dim: int
    mla_heads: int
    kv_lora: int
    qk_nope: int
    qk_rope: int
    v_head: int
    vocab: int
    experts: int = 0
    top_k: int = 1
    moe_intermediate: int = 0
    shared: int = 0

    def describe(self) -> str:
        mlp = (f"{self.experts} experts of {self.moe_intermediate}, top-{self.top_k}, "
               f"{self.shared} shared" if self.experts else
               f"intermediate {self.intermediate}")
        return (f"hidden {self.hidden}, {self.layers - 1} Kimi Delta Attention layers "
                f"({self.kda_heads} heads of {self.kda_dim}, a gate per key dim) and 1 MLA "
                f"layer ({self.mla_heads} heads, kv_lora {self.kv_lora}), {mlp}, vocab "
                f"{self.vocab}")

    def model_class(self):
        from mlx_lm.models.kimi_linear import Model

        return Model

    def model_args(self):
        from mlx_lm.models.kimi_linear import ModelArgs

        return ModelArgs(
            model_type="kimi_linear", vocab_size=self.vocab, hidden_size=self.hidden,
            num_hidden_layers=self.layers, num_attention_heads=self.mla_heads,
            num_key_value_heads=self.mla_heads, intermediate_size=self.intermediate,
            head_dim=self.qk_nope + self.qk_rope, rope_theta=10000.0, rms_norm_eps=1e-5,
            model_max_length=131072, num_experts=self.experts,
            moe_intermediate_size=self.moe_intermediate, kv_lora_rank=self.kv_lora,
            qk_nope_head_dim=self.qk_nope, qk_rope_head_dim=self.qk_rope,
            v_head_dim=self.v_head, mla_use_nope=True, num_experts_per_token=self.top_k,
            num_shared_experts=self.shared, first_k_dense_replace=1,
            linear_attn_config={"num_heads": self.kda_heads, "head_dim": self.kda_dim,
                                "short_conv_kernel_size": 4,
                                "kda_layers": list(range(1, self.layers))})


#: Kimi-Linear-48B-A3B's layer shapes, 4 layers (3 KDA + 1 MLA).
KIMI_LINEAR_4LAYER = KimiLinearShape(hidden=2304, intermediate=9216, layers=4, kda_heads=32,
                                     kda_dim=128, mla_heads=32, kv_lora=512, qk_nope=128,
                                     qk_rope=64, v_head=128, vocab=32000, experts=256,
                                     top_k=8, moe_intermediate=1024, shared=1)
#: Its CPU counterpart: hidden 512, the same KDA heads, dense MLPs.
KIMI_LINEAR_SMALL_4LAYER = KimiLinearShape(hidden=512, intermediate=1536, layers=4,
                                           kda_heads=32, kda_dim=128, mla_heads=4, kv_lora=128,
                                           qk_nope=64, qk_rope=32, v_head=64, vocab=8192)


def decode(shape, dtype: str, prompt: int):
    """``(patched step, stock step, info)``: one decode step (a token after a ``prompt``-token
    prefill, the caches filled by each side's own prefill) of ``shape``'s model, stock vs
    patched (decode runs the stock classes: this measures what the patch costs there)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_bricks.bench.e2e import _models
    from mlx_bricks.patch import patch_model

    stock, patched = _models(shape, dtype)
    report = patch_model(patched)
    tokens = mx.random.randint(0, shape.vocab, (1, prompt), key=mx.random.key(prompt))
    caches = {}
    for name, model in (("stock", stock), ("patched", patched)):
        caches[name] = make_prompt_cache(model)
        mx.eval(model(tokens, cache=caches[name]))
    tok = tokens[:, -1:]

    def info():
        return {"model": {"shape": shape.__dict__, "dtype": dtype, "prompt": prompt},
                "patch": {"backend": report.backend.name, "n_patched": report.n_patched,
                          "stock_calls": dict(report.stock_calls())}}

    return (lambda: patched(tok, cache=caches["patched"])[:, -1, :],
            lambda: stock(tok, cache=caches["stock"])[:, -1, :], info)


def recurrence_inputs(T: int, dtype="bf16", *, B: int = 1, Hk: int = 16, Hv: int = 32,
                      D: int = 128, seed: int = 0, vec: bool = False) -> dict:
    """Model-like inputs of one layer's recurrence (the tuner kind's synthetic values)."""
    import mlx.core as mx

    from mlx_bricks.bench.e2e import mx_dtype
    from mlx_bricks.bricks.gated_delta.kind import GATED_DELTA
    from mlx_bricks.runtime.kind import Act

    dt = mx_dtype(dtype)
    args = {"q": Act((B, T, Hk, D), dt), "k": Act((B, T, Hk, D), dt),
            "v": Act((B, T, Hv, D), dt),
            "g": Act((B, T, Hv, D) if vec else (B, T, Hv), mx.float32),
            "beta": Act((B, T, Hv), dt), "state": Act((B, Hv, D, D), mx.float32)}
    args = GATED_DELTA.synthetic(args, seed)
    mx.eval(list(args.values()))
    return args


def recurrence(T: int, dtype="bf16", *, Hk: int = 16, vec: bool = False):
    """``(brick, stock, info)``: the brick's ``gated_delta`` (auto backend; on the CPU its
    ``blas`` composite, the tuner's pick there) vs mlx-lm's recurrence
    (``gated_delta_stock``) on the same inputs; 32 value heads of 128, ``Hk`` key heads, a gate
    per key dim with ``vec``."""
    import mlx.core as mx

    from mlx_bricks.backends import active_backend
    from mlx_bricks.bricks.gated_delta.op import gated_delta, gated_delta_blas, gated_delta_stock

    args = recurrence_inputs(T, dtype, Hk=Hk, vec=vec)
    backend = active_backend(None).name
    cpu = backend == "reference" and mx.default_device() == mx.cpu

    def info():
        return {"T": T, "dtype": dtype, "backend": backend, "heads": f"{Hk}/32", "dim": 128,
                "gate": "per key dim" if vec else "per head",
                "brick": "blas composite" if cpu else "gated_delta op"}

    if cpu:
        return lambda: gated_delta_blas(**args)[0], lambda: gated_delta_stock(**args)[0], info
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
    for T in KDA_T_VALUES:
        name = f"kda_recurrence_bf16_t{T}"
        table[name] = Benchmark(
            name, KERNEL,
            f"Kimi Delta Attention recurrence of one Kimi-Linear-48B-A3B-shaped layer (32 "
            f"heads of 128, a gate per key dim), T={T} tokens, bf16, float32 state: mlx-lm's "
            "gated_delta_update recurrence vs the gated_delta brick",
            lambda T=T: recurrence(T, Hk=32, vec=True))
        name = f"e2e_kimi_linear_4layer_bf16_t{T}"
        table[name] = Benchmark(
            name, KERNEL,
            f"full-model prefill, T={T} tokens, bf16: Kimi-Linear-48B-A3B-shaped kimi_linear, "
            f"4 layers ({KIMI_LINEAR_4LAYER.describe()}), random weights; stock mlx-lm vs "
            "patch_model(tune='auto')", lambda T=T: setup(KIMI_LINEAR_4LAYER, "bf16", T))
    table["decode_kimi_linear_4layer_bf16_p2048"] = Benchmark(
        "decode_kimi_linear_4layer_bf16_p2048", KERNEL,
        "one decode step after a 2,048-token prompt, bf16: the Kimi-Linear-shaped 4-layer "
        "model, stock mlx-lm vs patched (decode runs the stock classes)",
        lambda: decode(KIMI_LINEAR_4LAYER, "bf16", 2048))
    for T in CPU_T_VALUES:
        name = f"kda_recurrence_cpu_bf16_t{T}"
        table[name] = Benchmark(
            name, CPU,
            f"Kimi Delta Attention recurrence on the CPU, T={T}, bf16, 32 heads of 128, a gate "
            "per key dim: mlx-lm's token loop vs the brick's blas composite",
            lambda T=T: recurrence(T, Hk=32, vec=True))
        name = f"e2e_kimi_linear_small_cpu_bf16_t{T}"
        table[name] = Benchmark(
            name, CPU,
            f"full-model prefill on the CPU, T={T} tokens, bf16: small Kimi-Linear-shaped "
            f"kimi_linear ({KIMI_LINEAR_SMALL_4LAYER.describe()}), random weights; stock "
            "mlx-lm vs patch_model(tune='auto') with no kernel backend (the composites)",
            lambda T=T: setup(KIMI_LINEAR_SMALL_4LAYER, "bf16", T))
        name = f"gdn_recurrence_cpu_bf16_t{T}"
        table[name] = Benchmark(
            name, CPU,
            f"Gated DeltaNet recurrence on the CPU, T={T}, bf16, 16/32 heads of 128: mlx-lm's "
            "token loop vs the brick's blas composite", lambda T=T: recurrence(T))
        name = f"e2e_qwen35_small_cpu_bf16_t{T}"
        table[name] = Benchmark(
            name, CPU,
            f"full-model prefill on the CPU, T={T} tokens, bf16: small Qwen3.5-shaped qwen3_5 "
            f"({QWEN35_SMALL_4LAYER.describe()}), random weights; stock mlx-lm vs "
            "patch_model(tune='auto') with no kernel backend (the chunked composite)",
            lambda T=T: setup(QWEN35_SMALL_4LAYER, "bf16", T))
        name = f"e2e_qwen35_small_cpu_bf16_q4g64_t{T}"
        table[name] = Benchmark(
            name, CPU,
            f"the same with its decoder layers' linears 4-bit gs64 (MLX affine) on both sides: "
            "the chunked composite and the GEMM kinds' NumPy-BLAS composites",
            lambda T=T: setup(QWEN35_SMALL_4LAYER, "bf16", T, fmt=(4, 64)))
    return table
