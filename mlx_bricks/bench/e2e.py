"""End-to-end benchmark: a whole model's prefill, stock mlx-lm vs ``patch_model(tune="auto")``.

The model is mlx-lm's own llama (``mlx_lm.models.llama``) with random weights, built twice on
the same parameter arrays: one instance stays stock, the other is patched, so both sides run in
one process on identical weights and are timed interleaved (``tune.timing``). One forward is
a prompt of M tokens run as mlx-lm's ``generate_step`` runs it (one prefill step): the
first M - 1 tokens into a fresh cache, the cache states evaluated (no logits: mlx-lm never
computes them for prompt positions), then the last token's logits (:data:`MEASURES`).
Until 2026-12-07 a forward evaluated the last position's logits of one M-token call, which
also ran the LM head over every prompt position (a cost both sides paid and users never do).
The patched side's first call (the timer's warm-up) takes the tuning decisions it needs; the
result reports them.

The lead's H200 command (bf16 and fp16, M = 512 / 2048 / 8192, one process)::

    mkdir -p bench/results && python -m mlx_bricks.bench --only e2e_llama8b_4layer --repeats 10 \
        --out bench/results/h200-e2e.json

The MoE cases (group ``e2e_qwen3_moe_4layer``) run :data:`QWEN3_MOE_4LAYER`, mlx-lm's
qwen3_moe with Qwen3-30B-A3B's layer shapes: the patch runs each ``SwitchGLU`` through the MoE
brick where the tuner measures it faster (the attention stays stock: qwen3_moe is not in the
patch table)::

    python -m mlx_bricks.bench --only e2e_qwen3_moe_4layer --repeats 10 \
        --out bench/results/h200-e2e-moe.json

The CPU cases (group ``e2e_small_llama_cpu``) run :data:`SMALL_LLAMA` where no kernel backend
exists: the patch tunes the composites of the quantized kinds against stock there.

The gpt-oss cases run mlx-lm's gpt_oss with its experts in ``mxfp4`` (as gpt-oss ships them;
the rest bf16): :data:`GPT_OSS_20B_4LAYER` on a kernel backend (group ``e2e_gpt_oss20b_4layer``)
and :data:`SMALL_GPT_OSS` on the CPU (``e2e_small_gpt_oss_cpu``); the patch runs each
``SwitchGLU`` through the MoE kind's ``dequant`` composite where faster (no kernel reads mxfp4;
the attention, with sinks, stays stock).
"""
from __future__ import annotations

from dataclasses import dataclass

#: dtypes of the e2e benchmarks (names as in the benchmark names).
DTYPES = ("bf16", "fp16")
#: Weight formats: float, or MLX affine (bits, group_size) by ``nn.quantize`` of the decoder
#: layers' linears (embedding and LM head stay float, as the patch leaves them stock anyway).
FORMATS = {"": None, "_q4g64": (4, 64), "_q8g64": (8, 64)}
#: What one timed forward is (recorded in each result).
MEASURES = ("prefill as mlx_lm generate_step: M - 1 tokens into a fresh cache, its states "
            "evaluated, then the last token's logits")


def prefill(model, tokens, step: int | None = None):
    """One prompt as mlx-lm's ``generate_step`` runs it: ``tokens`` (1, M) int but the last
    into a fresh cache (``make_prompt_cache``) in chunks of ``step`` tokens (None: one chunk),
    each chunk's cache states evaluated (no logits: mlx-lm never computes them for prompt
    positions), then the last token's logits, returned lazy: (1, vocab) in the model's dtype.
    Source: mlx_lm 0.32.2 ``generate.generate_step``."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    n = tokens.shape[1]
    step = step or max(1, n - 1)
    for i in range(0, n - 1, step):
        model(tokens[:, i:min(i + step, n - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    return model(tokens[:, -1:], cache=cache)[:, -1, :]


#: Prompt lengths (one prefill chunk each).
M_VALUES = (512, 2048, 8192)


class _Shape:
    """What the shapes share: mlx-lm's model class and ``ModelArgs`` of :attr:`model_type`
    (``mlx_lm.models.<model_type>``), built from :meth:`fields`."""

    model_type = ""

    def fields(self) -> dict:
        raise NotImplementedError

    def _module(self):
        import importlib

        return importlib.import_module(f"mlx_lm.models.{self.model_type}")

    def model_class(self):
        return self._module().Model

    def model_args(self):
        return self._module().ModelArgs(model_type=self.model_type, **self.fields())


@dataclass(frozen=True)
class LlamaShape(_Shape):
    """The shape of a llama model (mlx-lm ``ModelArgs`` fields)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    model_type = "llama"

    def describe(self) -> str:
        return (f"hidden {self.hidden}, intermediate {self.intermediate}, {self.heads}/"
                f"{self.kv_heads} heads of {self.head_dim}, vocab {self.vocab}")

    def fields(self) -> dict:
        return dict(hidden_size=self.hidden, num_hidden_layers=self.layers,
                    intermediate_size=self.intermediate, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                    rms_norm_eps=1e-5, vocab_size=self.vocab, rope_theta=500000.0,
                    tie_word_embeddings=False)


def _moe_describe(shape, width: int) -> str:
    return (f"hidden {shape.hidden}, {shape.experts} experts of {width}, top-{shape.top_k}, "
            f"{shape.heads}/{shape.kv_heads} heads of {shape.head_dim}, vocab {shape.vocab}")


@dataclass(frozen=True)
class Qwen3MoeShape(_Shape):
    """The shape of a qwen3_moe model (mlx-lm ``ModelArgs`` fields): every layer a MoE layer
    (``SwitchGLU`` experts, the router's top-k)."""

    hidden: int
    moe_intermediate: int
    experts: int
    top_k: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    model_type = "qwen3_moe"

    def describe(self) -> str:
        return _moe_describe(self, self.moe_intermediate)

    def fields(self) -> dict:
        return dict(hidden_size=self.hidden, num_hidden_layers=self.layers,
                    intermediate_size=4 * self.hidden, num_attention_heads=self.heads,
                    num_experts=self.experts, num_experts_per_tok=self.top_k,
                    decoder_sparse_step=1, mlp_only_layers=[],
                    moe_intermediate_size=self.moe_intermediate, rms_norm_eps=1e-6,
                    vocab_size=self.vocab, num_key_value_heads=self.kv_heads,
                    head_dim=self.head_dim, rope_theta=1000000.0, tie_word_embeddings=False,
                    max_position_embeddings=40960, norm_topk_prob=True)


@dataclass(frozen=True)
class GptOssShape(_Shape):
    """The shape of a gpt_oss model (mlx-lm ``ModelArgs`` fields): every layer a MoE layer
    (SwigluOAI experts with biases), sliding-window layers between full ones."""

    hidden: int
    intermediate: int
    experts: int
    top_k: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    model_type = "gpt_oss"

    def describe(self) -> str:
        return _moe_describe(self, self.intermediate)

    def fields(self) -> dict:
        return dict(hidden_size=self.hidden, num_hidden_layers=self.layers,
                    intermediate_size=self.intermediate, num_local_experts=self.experts,
                    num_experts_per_tok=self.top_k, num_attention_heads=self.heads,
                    num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                    vocab_size=self.vocab, sliding_window=128)


#: gpt-oss-20b's layer shapes, 4 layers (a 32000-token vocabulary as for the llama case).
GPT_OSS_20B_4LAYER = GptOssShape(hidden=2880, intermediate=2880, experts=32, top_k=4, layers=4,
                                 heads=64, kv_heads=8, head_dim=64, vocab=32000)
#: A small gpt_oss for the CPU (gpt-oss-20b's expert count and top-k).
SMALL_GPT_OSS = GptOssShape(hidden=512, intermediate=512, experts=32, top_k=4, layers=2,
                            heads=8, kv_heads=1, head_dim=64, vocab=8192)
#: The gpt-oss cases' expert format (a ``mx.quantize`` mode: the experts only).
GPT_OSS_FORMAT = "mxfp4"

#: Qwen3-30B-A3B's layer shapes, 4 layers (the 32000-token vocabulary as for the llama case).
QWEN3_MOE_4LAYER = Qwen3MoeShape(hidden=2048, moe_intermediate=768, experts=128, top_k=8,
                                 layers=4, heads=32, kv_heads=4, head_dim=128, vocab=32000)
#: The MoE cases: bf16, float or 4-bit gs64 weights (experts and attention), M as above.
MOE_DTYPES = ("bf16",)
MOE_FORMATS = {"": None, "_q4g64": (4, 64)}

#: Llama-3-8B's layer shapes, 4 layers (llama 2's 32000-token vocabulary keeps the LM head,
#: which is stock on both sides, from dominating).
LLAMA_8B_4LAYER = LlamaShape(hidden=4096, intermediate=14336, layers=4, heads=32, kv_heads=8,
                             head_dim=128, vocab=32000)

#: A small llama for the CPU cases: MLX 0.32.4's CPU ``quantized_matmul`` with float16
#: activations takes seconds per call at SmolLM-135M's layer shapes, so stock's side of a
#: 512-token prefill of this model already takes about a minute on 2 cores.
SMALL_LLAMA = LlamaShape(hidden=256, intermediate=768, layers=2, heads=4, kv_heads=2,
                         head_dim=64, vocab=8192)
#: The CPU cases' dtypes, weight formats and prompt lengths.
CPU_DTYPES = ("fp16", "bf16")
CPU_FORMATS = {"_q4g64": (4, 64), "_q8g64": (8, 64)}
CPU_M_VALUES = (128, 512)

_MODELS: dict = {}


def mx_dtype(name: str):
    """The ``mx.Dtype`` of a bench dtype name: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (KeyError
    for another)."""
    import mlx.core as mx

    return {"bf16": mx.bfloat16, "fp16": mx.float16, "fp32": mx.float32}[name]


def _quantized_layer(path: str, module) -> bool:
    """What ``nn.quantize`` quantizes in the benchmarks: the decoder layers' linears and MoE
    experts (``SwitchLinear``), not a MoE router (``mlp.gate``, kept float as mlx-lm's 4-bit
    MoE checkpoints keep it at higher precision)."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchLinear

    # "model.layers.", "backbone.layers." (nemotron_h, mamba) or, in the multimodal wrappers
    # (qwen3_5), "language_model.model.layers."
    return (isinstance(module, (nn.Linear, SwitchLinear))
            and (path.startswith(("model.layers.", "backbone.layers."))
                 or ".model.layers." in path)
            and not path.endswith("mlp.gate"))


def _models(shape, dtype: str, fmt=None):
    """(stock, patched-to-be) instances of one random model (``shape``: a :class:`LlamaShape`
    or :class:`Qwen3MoeShape`) on shared parameter arrays; one shape, dtype and format is kept
    at a time (an 8B-shaped 4-layer model is about 2 GB)."""
    import mlx.core as mx
    import mlx.nn as nn

    Model = shape.model_class()

    key = (shape, dtype, fmt)
    if key not in _MODELS:
        _MODELS.clear()
        mx.random.seed(0)
        models = [Model(shape.model_args()) for _ in range(2)]
        stock, patched = models
        stock.set_dtype(mx_dtype(dtype))
        if isinstance(fmt, str):  # a microscaling mode: the MoE experts only (gpt-oss's way)
            from mlx_lm.models.switch_layers import SwitchLinear

            from mlx_bricks.formats.microscaling import MODES

            for m in models:
                nn.quantize(m, group_size=MODES[fmt].group_size, bits=MODES[fmt].bits,
                            mode=fmt, class_predicate=lambda p, mod: isinstance(
                                mod, SwitchLinear))
        elif fmt is not None:
            for m in models:
                nn.quantize(m, group_size=fmt[1], bits=fmt[0], class_predicate=_quantized_layer)
        mx.eval(stock.parameters())
        patched.update(stock.parameters())  # the same arrays; its own init is never evaluated
        _MODELS[key] = (stock, patched)
    return _MODELS[key]


def setup(shape, dtype: str, M: int, *, tune: str = "auto", fmt=None):
    """``(patched forward, stock forward, info)`` for ``mlx_bricks.bench.core.Benchmark``.

    Args:
        shape: the model shape (:class:`LlamaShape` or :class:`Qwen3MoeShape`).
        dtype: ``"bf16"`` or ``"fp16"``.
        M: prompt tokens (one chunk).
        tune: ``patch_model(tune=...)``.
        fmt: None (float weights), ``(bits, group_size)``: the decoder layers' linears
            quantized with ``nn.quantize`` (MLX affine), on both sides; or a microscaling mode
            (``"mxfp4"``): the MoE experts only.

    Where stock's forward raises (MLX 0.32.4 CUDA's ``gather_qmm`` at 65,536 routed rows, its
    sort kernels above 65,535 rows; an 8,192-token prompt's prefill step of 8,191 tokens with
    top-8 routes 65,528), ``bench.core.run_one`` records ``stock_error`` and reports no stock
    figure.

    Raises:
        ValueError: an unknown dtype.
    """
    import mlx.core as mx

    from mlx_bricks.patch import patch_model

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    stock, patched = _models(shape, dtype, fmt)
    report = patch_model(patched, tune=tune)
    tokens = mx.random.randint(0, shape.vocab, (1, M), key=mx.random.key(M))

    def forward(model):
        return prefill(model, tokens)

    def info() -> dict:
        tuning = report.tuning()
        return {"measures": MEASURES,
                "model": {"shape": shape.__dict__, "dtype": dtype, "M": M,
                          "weights": "float" if fmt is None else
                          f"{fmt} experts" if isinstance(fmt, str) else
                          f"affine {fmt[0]}-bit, group_size {fmt[1]}"},
                "patch": {"backend": report.backend.name, "n_patched": report.n_patched,
                          "dequant_cap": report.options["dequant_cap"],
                          "all_stock": report.all_stock, "calls": dict(report.calls()),
                          "tuned_stock_calls": dict(report.tuned_stock_calls()),
                          "stock_calls": dict(report.stock_calls())},
                "tuning": tuning}

    return (lambda: forward(patched), lambda: forward(stock), info)
