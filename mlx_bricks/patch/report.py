"""PatchReport: what patch_model did per layer, why it left things stock, and live counters."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_bricks.backends import BackendChoice
from mlx_bricks.bricks.swiglu.piece import MLP_PIECE
from mlx_bricks.nn.calls import DECODE
from mlx_bricks.nn.runner import BricksState
from mlx_bricks.nn.structure import weight_formats

PATCHED, FALLBACK, DISABLED, STOCK = "patched", "fallback", "disabled", "stock"


@dataclass(eq=False)
class ModuleReport:
    """One module of one layer (or the whole model when ``layer`` is None).

    Attributes:
        layer: decoder layer index, or None for a model-level entry.
        module: ``"block"`` (unified block), ``"self_attn"``, ``"mlp"`` or ``"model"``.
        status: ``"patched"``, ``"fallback"`` (left stock for ``reason``: the bricks do not
            cover it), ``"disabled"`` (left stock because the caller asked, e.g.
            ``attention=False``) or ``"stock"`` (the bricks cover it, but it is left stock on
            purpose: no kernel backend on this machine).
        bricks: op names the module runs in prefill (empty unless patched).
        variant: brick options in words (``"kv_quant=q8_0"``, ``"swiglu=fused"``).
        backend: backend name of the bricks (empty unless patched).
        reason: why the module is not patched (empty when patched).
        rope: how RoPE is applied (attention and block entries).
        weights: projection name -> weight format of the linear layers the module's bricks
            read (``"q4 gs64"`` for an MLX affine ``nn.QuantizedLinear``, ``"float16"`` for an
            ``nn.Linear``; ``formats.layers.format_name``); empty for a model-level entry.
        state: the module's live :class:`BricksState` (None unless patched).
    """

    layer: int | None
    module: str
    status: str
    bricks: tuple[str, ...] = ()
    variant: str = ""
    backend: str = ""
    reason: str = ""
    rope: str = ""
    weights: dict = field(default_factory=dict)
    state: BricksState | None = field(default=None, repr=False)

    @property
    def weight_summary(self) -> str:
        """The weight formats in a few words (:func:`summarize_formats`)."""
        return summarize_formats(self.weights)

    @property
    def calls(self) -> dict[str, int]:
        """Brick op name -> prefill calls so far."""
        return dict(self.state.calls) if self.state is not None else {}

    @property
    def stock_calls(self) -> dict[str, int]:
        """Reason -> calls that ran the stock path so far because the bricks do not cover them
        (decode included; a piece's stock path is counted as ``"<piece>: <reason>"``)."""
        if self.state is None:
            return {}
        if self.state.gate is not None:  # decode forwards the gate counted
            self.state.gate.flush()
        return dict(self.state.stock)

    @property
    def tuned_stock_calls(self) -> dict[str, int]:
        """``"<piece>: tuned: stock faster (x0.93)"`` -> calls where tuning chose stock."""
        return dict(self.state.tuned) if self.state is not None else {}

    def to_dict(self) -> dict:
        return {
            "layer": self.layer, "module": self.module, "status": self.status,
            "bricks": list(self.bricks), "variant": self.variant, "backend": self.backend,
            "reason": self.reason, "rope": self.rope, "weights": self.weight_summary,
            "weight_formats": dict(self.weights), "calls": self.calls,
            "stock_calls": self.stock_calls, "tuned_stock_calls": self.tuned_stock_calls,
        }


def summarize_formats(formats: dict) -> str:
    """``{projection: format}`` in a few words: the format when all share it (``"q4 gs64"``),
    else the most common one followed by the others with their projections
    (``"q3 gs64 (v_proj, down_proj: q6 gs64)"``); ``""`` for none."""
    if not formats:
        return ""
    counts = Counter(formats.values())
    main = max(counts, key=lambda f: (counts[f], -list(formats.values()).index(f)))
    others = {}
    for name, f in formats.items():
        if f != main:
            others.setdefault(f, []).append(name)
    if not others:
        return main
    rest = "; ".join(f"{', '.join(names)}: {f}" for f, names in others.items())
    return f"{main} ({rest})"


def record_weight_formats(report: "PatchReport", layers, layout) -> None:
    """Fill ``weights`` of every layer entry of ``report`` from the model's ``layers`` (the
    modules as they are at patch time; a MoE block's shared expert, ``"mlp.shared_experts"``,
    read as an MLP)."""
    shared = f"{layout.mlp}.{layout.shared_expert}" if layout.shared_expert else None
    for m in report.modules:
        if m.layer is None or m.module not in ("block", "self_attn", "mlp", shared):
            continue
        layer = layers[m.layer]
        if m.module == shared:
            sparse = getattr(layer, layout.mlp, None)
            module, role = getattr(sparse, layout.shared_expert, None), "mlp"
        else:
            module, role = {"block": layer, "self_attn": getattr(layer, layout.attention, None),
                            "mlp": getattr(layer, layout.mlp, None)}[m.module], m.module
        if module is not None:
            piece = MLP_PIECE if role == MLP_PIECE.role else None
            formats = weight_formats(module, role, layout, piece)
            # a module with none of the layout's linears (a MoE block in the mlp slot) has none
            m.weights = {} if set(formats.values()) == {"missing"} else formats


@dataclass(eq=False)
class PatchReport:
    """Result of :func:`mlx_bricks.patch.patch_model`.

    Attributes:
        model_type: the model's ``model_type`` (None if it has none).
        architecture: the patch-table entry used (``"llama"`` for mistral), or None.
        backend: the :class:`~mlx_bricks.backends.BackendChoice` every brick runs on.
        options: the ``patch_model`` keyword arguments.
        n_layers: decoder layers found.
        modules: one :class:`ModuleReport` per (layer, module), in layer order.
        dispatch: the model's ``mlx_bricks.runtime.dispatch.Dispatch`` (tuning decisions, the
            guard's reasons), or None when nothing was patched on purpose (no kernel backend).
        kv_caches: with ``kv_cache="q8_0"``, one ``(layer, cache kind, reason)`` per layer:
            what ``mlx_bricks.make_prompt_cache(model)`` builds (empty for ``"fp16"``).
        warm_s: seconds the patch spent paying the composites' first-use costs
            (``bricks.dequantize.composite.warm_first_use``; 0.0 where none).

    Counters and decisions are live: run the model, then read ``calls()`` / ``tuning()`` /
    ``str(report)`` again.
    """

    model_type: str | None
    architecture: str | None
    backend: BackendChoice
    options: dict
    n_layers: int = 0
    modules: list[ModuleReport] = field(default_factory=list)
    dispatch: object = field(default=None, repr=False)
    kv_caches: list = field(default_factory=list)
    warm_s: float = 0.0

    @property
    def n_patched(self) -> int:
        """Modules that run prefill through the bricks."""
        return sum(m.status == PATCHED for m in self.modules)

    @property
    def n_fallback(self) -> int:
        """Modules left stock at patch time because the bricks do not cover them."""
        return sum(m.status == FALLBACK for m in self.modules)

    @property
    def n_stock(self) -> int:
        """Modules the bricks cover but that were left stock on purpose (no kernel backend)."""
        return sum(m.status == STOCK for m in self.modules)

    @property
    def all_stock(self) -> bool:
        """True when no module was patched: the model runs exactly the stock code."""
        return self.n_patched == 0

    @property
    def fallbacks(self) -> list[ModuleReport]:
        """The patch-time fallbacks, each with its reason."""
        return [m for m in self.modules if m.status == FALLBACK]

    def layer(self, index: int) -> list[ModuleReport]:
        """Entries of decoder layer ``index``."""
        return [m for m in self.modules if m.layer == index]

    def calls(self) -> Counter:
        """Brick op name -> prefill calls, summed over all patched modules."""
        total = Counter()
        for m in self.modules:
            total.update(m.calls)
        return total

    def stock_calls(self) -> Counter:
        """Reason -> calls of patched modules that ran the stock path (decode included)."""
        total = Counter()
        for m in self.modules:
            total.update(m.stock_calls)
        return total

    def runtime_fallbacks(self) -> Counter:
        """Like :meth:`stock_calls` without decode: call-time fallbacks only."""
        return Counter({r: n for r, n in self.stock_calls().items() if r != DECODE})

    def tuned_stock_calls(self) -> Counter:
        """``"<piece>: tuned: stock faster (x0.93)"`` -> calls, summed over the modules."""
        total = Counter()
        for m in self.modules:
            total.update(m.tuned_stock_calls)
        return total

    def tuning(self) -> dict:
        """Tuning as of now: ``mode``, ``applies``, ``why``, the ``decisions`` taken (key,
        winner, ratio = stock time / best brick time, reason, source: cache or measured) and
        the guard's ``disabled`` reasons (see ``Dispatch.summary``)."""
        if self.dispatch is None:
            return {"mode": self.options.get("tune"), "applies": False,
                    "why": "nothing patched" + (f": {self.modules[0].reason}"
                                                if self.n_stock else ""),
                    "decisions": [], "disabled": []}
        return self.dispatch.summary()

    def to_dict(self) -> dict:
        """JSON-serialisable snapshot (counters as of now)."""
        b = self.backend
        return {
            "model_type": self.model_type,
            "architecture": self.architecture,
            "backend": {"name": b.name, "source": b.source, "reason": b.reason},
            "options": dict(self.options),
            "n_layers": self.n_layers,
            "n_patched": self.n_patched,
            "n_fallback": self.n_fallback,
            "n_stock": self.n_stock,
            "all_stock": self.all_stock,
            "modules": [m.to_dict() for m in self.modules],
            "calls": dict(self.calls()),
            "stock_calls": dict(self.stock_calls()),
            "tuned_stock_calls": dict(self.tuned_stock_calls()),
            "tuning": self.tuning(),
            "kv_caches": [{"layer": i, "kind": k, "reason": r} for i, k, r in self.kv_caches],
        }

    def __str__(self) -> str:
        opts = " ".join(f"{k}={v}" for k, v in self.options.items())
        arch = self.architecture or "unsupported"
        lines = [
            f"mlx-bricks patch: model_type={self.model_type!r} (table entry: {arch}), "
            f"{self.n_layers} layers",
            f"backend: {self.backend}",
            f"options: {opts}",
            f"patched modules: {self.n_patched}, fallbacks: {self.n_fallback}"
            + (f", left stock: {self.n_stock}" if self.n_stock else ""),
        ]
        tuning = self.tuning()
        if self.dispatch is not None:
            lines.append(f"tuning: {tuning['why']}")
        lines.append(f"memory: peak so far {mx.get_peak_memory() / 2**20:.1f} MiB (the "
                     f"process's, MLX's counter); dequant cap "
                     f"{self.options.get('dequant_cap', '-')} of transient float weights")
        rows = [("layer", "module", "status", "backend", "variant", "weights",
                 "bricks: prefill calls", "stock-path calls")]
        for m in self.modules:
            layer = "-" if m.layer is None else str(m.layer)
            if m.status == PATCHED:
                calls = m.calls
                bricks = " ".join(f"{b}:{calls.get(b, 0)}" for b in m.bricks)
                stock = sum(m.stock_calls.values()) + sum(m.tuned_stock_calls.values())
                row = (m.backend, m.variant, m.weight_summary or "-", bricks, str(stock))
            else:
                row = ("-", "-", m.weight_summary or "-", "-", "-")
            rows.append((layer, m.module, m.status, *row))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        not_patched = [m for m in self.modules if m.status not in (PATCHED, STOCK)]
        if not_patched:
            lines.append("left stock:")
            for m in not_patched:
                where = "model" if m.layer is None else f"layer {m.layer} {m.module}"
                lines.append(f"  {where} ({m.status}): {m.reason}")
        kept = [m for m in self.modules if m.status == STOCK]
        if kept:
            lines.append(f"left stock on purpose ({len(kept)} modules): {kept[0].reason}")
        if tuning["decisions"]:
            lines.append("tuning decisions (ratio = stock time / brick time):")
            for d in tuning["decisions"]:
                lines.append(f"  {d['key']}: {d['winner']} - {d['reason']} [{d['source']}]")
        if tuning["disabled"]:
            lines.append("disabled for this process (pieces run stock):")
            lines += [f"  {r}" for r in tuning["disabled"]]
        if self.kv_caches:
            kinds = Counter(k for _, k, _ in self.kv_caches)
            lines.append("KV cache per layer (kv_cache=q8_0): " + ", ".join(
                f"{k} x {n}" for k, n in sorted(kinds.items())))
            for reason in sorted({r for _, k, r in self.kv_caches if k != "Q8KVCache"}):
                layers = [str(i) for i, _, r in self.kv_caches if r == reason]
                lines.append(f"  layers {','.join(layers)}: {reason}")
        ropes = sorted({m.rope for m in self.modules if m.rope})
        for rope in ropes:
            lines.append(f"rope: {rope}")
        runtime = self.runtime_fallbacks()
        if runtime:
            lines.append("call-time fallbacks (stock path):")
            lines += [f"  {n} x {reason}" for reason, n in sorted(runtime.items())]
        tuned = self.tuned_stock_calls()
        if tuned:
            lines.append("tuned stock paths (stock measured faster):")
            lines += [f"  {n} x {reason}" for reason, n in sorted(tuned.items())]
        decode = self.stock_calls().get(DECODE, 0)
        if decode:
            lines.append(f"stock-path calls that were decode (stock by design): {decode}")
        return "\n".join(lines)
