"""``python -m mlx_bricks.patch [MODEL_DIR]``: patch a model, check it against stock, time it.

Loads the model (an mlx-lm directory, or a ``.gguf`` file through the importer; default: the
embedded default model), runs the prompt through the stock model, patches the same instance in
place with :func:`mlx_bricks.patch.patch_model`, runs the prompt again, and prints the per-layer
report and these figures:

* ``max_abs_delta_logits_last``, ``max_abs_delta_logits_all``: max |patched - stock| of the
  logits (float32) at the prompt's last position, and over every prompt position;
* ``top1_agreement``: fraction of prompt positions whose argmax token is the same;
* ``greedy_match``: whether the greedy continuations (``--max-tokens`` tokens through mlx-lm's
  ``generate_step``, stopping at EOS) are identical;
* ``prompt_tps_stock``, ``prompt_tps_patched``, ``prompt_tps_ratio`` (patched / stock): prompt
  tokens / median wall time of a full prefill with a fresh KV cache (chunks of
  ``--prefill-step-size``, the cache states evaluated, then the last token's logits, as
  mlx-lm's generate does),
  over ``--repeats`` runs each after one warm-up run, stock and patched alternating on the same
  model instance (the patched one run through its original classes for stock).

The check passes when the greedy continuations are identical, top-1 agreement is 100% and at least
one module is patched, or every module was left stock on purpose (no kernel backend on this
machine: the patched model is then the stock model). Exit status: 0 pass, 1 fail, 2 bad input
(one line on stderr), 130 Ctrl-C.
``--json`` prints one JSON object (the figures, ``passed``, ``fail_reasons`` and the report)
instead of the text.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from mlx_bricks import _cli
from mlx_bricks.entry import flags
from mlx_bricks.entry.resolve import load_patchable

PROG = "python -m mlx_bricks.patch"
DEFAULT_PROMPT = (
    "Summarise in three sentences how a transformer language model turns a prompt into its "
    "first output token: the tokenizer, the embedding, the attention and MLP layers of every "
    "block, the final norm and the vocabulary projection."
)
DEFAULT_MAX_TOKENS = 16
DEFAULT_REPEATS = 3
DEFAULT_PREFILL_STEP_SIZE = 2048


def setup_arg_parser() -> argparse.ArgumentParser:
    """Parser of ``python -m mlx_bricks.patch``; a bad flag value exits 2 with one line."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Patch an mlx-lm model with the mlx-bricks kernels, compare it with the stock "
        "model on one prompt (logits, top-1, greedy tokens) and time the prefill both ways. "
        "Exit status: 0 pass, 1 fail, 2 bad input.",
    )
    parser.add_argument(
        "model_dir", metavar="MODEL_DIR", nargs="?", default=None,
        help="mlx-lm model directory or .gguf file (default: the embedded default model, "
        "SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--prompt", "-p", default=DEFAULT_PROMPT,
                        help="prompt text (default: a fixed paragraph)")
    parser.add_argument("--max-tokens", "-m", type=_cli.positive_int, default=DEFAULT_MAX_TOKENS,
                        help=f"greedy tokens to compare (default: {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of the text report")
    flags.add_backend_flag(parser, "--backend", "--bricks-backend", dest="backend")
    parser.add_argument("--kv-quant", dest="kv_quant", choices=("none", "q8_0"), default="none",
                        help="patch_model(kv_quant=...): q8_0 rounds K and V to Q8_0 blocks "
                        "inside the attention brick; mlx-lm's float cache is kept (not the Q8_0 "
                        "KV cache of the CLIs' --bricks-kv). Default: none.")
    flags.add_mlp_variant_flag(parser, "--mlp-variant", "--bricks-mlp-variant",
                               dest="mlp_variant")
    flags.add_tune_flag(parser, "--tune", "--bricks-tune", dest="tune")
    parser.add_argument("--no-attention", dest="attention", action="store_false",
                        help="leave attention stock")
    parser.add_argument("--no-mlp", dest="mlp", action="store_false", help="leave the MLP stock")
    parser.add_argument("--no-fuse-block", dest="fuse_block", action="store_false",
                        help="patch attention and MLP separately, not as one block")
    parser.add_argument("--repeats", type=_cli.positive_int, default=DEFAULT_REPEATS,
                        help=f"timed prefill runs per model, after one warm-up "
                        f"(default: {DEFAULT_REPEATS})")
    parser.add_argument("--prefill-step-size", type=_cli.positive_int,
                        default=DEFAULT_PREFILL_STEP_SIZE,
                        help=f"prompt tokens per prefill chunk, as in mlx_lm.generate "
                        f"(default: {DEFAULT_PREFILL_STEP_SIZE})")
    parser.add_argument("--ignore-chat-template", action="store_true",
                        help="use the raw prompt without the tokenizer's chat template")
    return _cli.one_line_errors(parser)


def encode_prompt(tokenizer, prompt: str, use_chat_template: bool) -> list[int]:
    """Token ids of ``prompt`` as ``mlx_lm.generate`` builds them (chat template when the
    tokenizer has one and ``use_chat_template``)."""
    if use_chat_template and tokenizer.has_chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def _prefill(model, prompt, step: int):
    """Logits (1, L, vocab) of a full prefill with a fresh cache, in chunks of ``step``."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    chunks = [model(prompt[None, i : i + step], cache=cache) for i in range(0, prompt.size, step)]
    return mx.concatenate(chunks, axis=1) if len(chunks) > 1 else chunks[0]


def _timed_prefill(model, prompt, step: int) -> float:
    """Seconds of one prefill as mlx-lm's ``generate_step`` runs it (``bench.e2e.prefill``:
    chunks of ``step`` tokens, the cache states evaluated, then the last token's logits)."""
    import mlx.core as mx

    from mlx_bricks.bench.e2e import prefill

    start = time.perf_counter()
    mx.eval(prefill(model, prompt[None], step))
    return time.perf_counter() - start


def measure(model, tokenizer, prompt, *, max_tokens: int, step: int) -> dict:
    """One model's side of the check (the first prefill is also where a patched model takes
    its tuning decisions).

    Returns:
        ``{"logits": mx.array (L, vocab) float32, "tokens": [int], "text": str}``.
    """
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import greedy_sampler

    logits = _prefill(model, prompt, step)[0].astype(mx.float32)
    mx.eval(logits)
    tokens = []
    eos = set(tokenizer.eos_token_ids)
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens, sampler=greedy_sampler,
                                  prefill_step_size=step):
        token = int(token)
        if token in eos:
            break
        tokens.append(token)
    return {"logits": logits, "tokens": tokens, "text": tokenizer.decode(tokens)}


def time_both(model, prompt, *, repeats: int, step: int) -> tuple[list[float], list[float]]:
    """``(stock seconds, patched seconds)`` of ``repeats`` full prefills each of the patched
    ``model``, alternating with the same instance run stock (``patch.core.stock_path``), after
    one warm-up each: both sides see the same machine state, in one process."""
    from mlx_bricks.patch.core import stock_path

    with stock_path(model):
        _timed_prefill(model, prompt, step)
    _timed_prefill(model, prompt, step)
    t_stock, t_patched = [], []
    for r in range(repeats):
        for side in (("stock", "patched") if r % 2 == 0 else ("patched", "stock")):
            if side == "stock":
                with stock_path(model):
                    t_stock.append(_timed_prefill(model, prompt, step))
            else:
                t_patched.append(_timed_prefill(model, prompt, step))
    return t_stock, t_patched


def compare(stock: dict, patched: dict, n_prompt: int) -> dict:
    """The figures (see the module docstring) from two :func:`measure` results."""
    import mlx.core as mx

    delta = mx.abs(patched["logits"] - stock["logits"])
    agree = mx.argmax(patched["logits"], axis=-1) == mx.argmax(stock["logits"], axis=-1)
    t_stock = statistics.median(stock["prefill_s"])
    t_patched = statistics.median(patched["prefill_s"])
    return {
        "max_abs_delta_logits_last": delta[-1].max().item(),
        "max_abs_delta_logits_all": delta.max().item(),
        "max_abs_logits_stock": mx.abs(stock["logits"]).max().item(),
        "top1_agreement": agree.astype(mx.float32).mean().item(),
        "greedy_match": stock["tokens"] == patched["tokens"],
        "prompt_tps_stock": n_prompt / t_stock,
        "prompt_tps_patched": n_prompt / t_patched,
        "prompt_tps_ratio": t_stock / t_patched,
    }


def verdict(figures: dict, n_patched: int, n_stock: int = 0) -> list[str]:
    """Reasons the check fails (empty: it passes). ``n_stock``: modules left stock on purpose
    (no kernel backend); a model with none patched passes when that is why."""
    reasons = []
    if n_patched == 0 and n_stock == 0:
        reasons.append("no module was patched (see the report for why)")
    if figures["top1_agreement"] < 1.0:
        reasons.append(f"top-1 agreement {figures['top1_agreement']:.2%} < 100%")
    if not figures["greedy_match"]:
        reasons.append("greedy continuations differ")
    return reasons


def _format_text(result: dict, report) -> str:
    f = result
    lines = [
        str(report),
        "",
        f"model: {f['model']} ({f['model_type']}), prompt: {f['prompt_tokens']} tokens, "
        f"backend: {f['backend']['name']}",
        f"max |delta logits|: last position {f['max_abs_delta_logits_last']:.4g}, "
        f"all positions {f['max_abs_delta_logits_all']:.4g} "
        f"(max |stock logits| {f['max_abs_logits_stock']:.4g})",
        f"top-1 agreement: {f['top1_agreement']:.2%} of {f['prompt_tokens']} positions",
        f"greedy continuations ({f['max_tokens']} tokens): "
        + ("identical" if f["greedy_match"] else "DIFFER"),
        f"  stock:   {f['stock_text']!r}",
        f"  patched: {f['patched_text']!r}",
        f"prompt tokens/s: stock {f['prompt_tps_stock']:.1f}, patched "
        f"{f['prompt_tps_patched']:.1f}, ratio {f['prompt_tps_ratio']:.2f}x "
        f"(median of {f['repeats']})",
    ]
    if f["all_stock"] and f["stock_reason"]:
        lines.append(f"every module left stock: {f['stock_reason']} (the two runs are the same "
                     "computation; the ratio is timing noise)")
    if f["passed"]:
        lines.append("PASS")
    else:
        lines.append("FAIL: " + "; ".join(f["fail_reasons"]))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Load, measure stock, patch, measure patched, print; returns the exit status."""
    if not args.prompt.strip():
        raise _cli.CliError("--prompt is empty")
    import mlx.core as mx
    from mlx_lm import load

    from mlx_bricks.patch import patch_model

    model_dir, (model, tokenizer) = load_patchable(args.model_dir, args.backend,
                                                   lambda p: load(str(p)))
    prompt = mx.array(encode_prompt(tokenizer, args.prompt, not args.ignore_chat_template))
    opts = {"max_tokens": args.max_tokens, "step": args.prefill_step_size}

    stock = measure(model, tokenizer, prompt, **opts)
    report = patch_model(model, attention=args.attention, mlp=args.mlp,
                         fuse_block=args.fuse_block,
                         kv_quant=None if args.kv_quant == "none" else args.kv_quant,
                         mlp_variant=flags.mlp_variant(args.mlp_variant),
                         backend=args.backend, tune=args.tune)
    patched = measure(model, tokenizer, prompt, **opts)
    stock["prefill_s"], patched["prefill_s"] = time_both(model, prompt, repeats=args.repeats,
                                                         step=args.prefill_step_size)

    figures = compare(stock, patched, prompt.size)
    reasons = verdict(figures, report.n_patched, report.n_stock)
    stock_reasons = sorted({m.reason for m in report.modules if m.status == "stock"})
    result = {
        "model": str(model_dir),
        "model_type": report.model_type,
        "backend": {"name": report.backend.name, "source": report.backend.source,
                    "reason": report.backend.reason},
        "prompt_tokens": int(prompt.size),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        **figures,
        "all_stock": report.all_stock,
        "stock_reason": "; ".join(stock_reasons),
        "tune": args.tune,
        "stock_tokens": stock["tokens"],
        "patched_tokens": patched["tokens"],
        "stock_text": stock["text"],
        "patched_text": patched["text"],
        "passed": not reasons,
        "fail_reasons": reasons,
        "report": report.to_dict(),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(_format_text(result, report))
    return _cli.EXIT_OK if not reasons else _cli.EXIT_FAIL


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring. Returns 0 (pass) or 1 (fail).

    Raises:
        SystemExit: 2 on bad input (one line on stderr), 130 on Ctrl-C.
    """
    args = setup_arg_parser().parse_args(argv)
    return _cli.run_cli(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
