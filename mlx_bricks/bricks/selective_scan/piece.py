"""The selective-scan brick's piece in a patched mlx-lm model: a Mamba-1 mixer module whose
prefill runs its projections (``in_proj``, ``x_proj``, ``dt_proj``, ``out_proj``) as ``linear``
stages on the GEMM brick where the dispatch chooses it (else its own layers), its causal conv1d
+ SiLU as a ``short_conv`` stage (the conv state written to the cache as the module writes it),
its own B / C / time-step norms, then the brick's scan
(:data:`~mlx_bricks.bricks.selective_scan.kind.SELECTIVE_SCAN_KIND`) instead of its token loop,
then ``out_proj(swiglu(z, y))``; the recurrent state is written as the module writes it (in the
dtype its loop leaves there).

The forms this piece follows (mlx-lm 0.32.2; :data:`FORMS`): jamba ``JambaMambaMixer``
(RMSNorm modules on the time steps, B and C) and mamba ``MambaBlock`` (Mamba-1 and
Falcon-Mamba: weightless RMS norms when ``use_bcdt_rms``). Each is vetted by its ``__call__``,
``_process_sequence`` and ``ssm_step``; any other Mamba-1-like module (a class named Mamba with
an ``ssm_step``) stays stock with the reason.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.bricks.selective_scan.kind import SELECTIVE_SCAN_KIND
from mlx_bricks.bricks.short_conv.kind import SHORT_CONV
from mlx_bricks.bricks.short_conv.piece import conv_bias_reason, depthwise_reason
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.runtime.scan import arrays_cache_reason
from mlx_bricks.runtime.classes import base_class, class_key

#: The mixer's name in reports.
MIXER = "Mamba-1 (selective scan)"
#: ``"<module>.<Class>"`` -> whether its B / C / time-step norms are the RMSNorm modules
#: ``dt_layernorm``, ``b_layernorm``, ``c_layernorm`` (jamba) or weightless ``mx.fast.rms_norm``
#: under ``use_bcdt_rms`` (mamba).
FORMS: dict[str, str] = {"jamba.JambaMambaMixer": "modules", "mamba.MambaBlock": "bcdt_rms"}
#: The vetted fingerprints (``patch.vetted``) of each form's forward and helpers.
_VETTED = {
    "jamba.JambaMambaMixer": dict(__call__="eb226296799b", _process_sequence="1057c740c6e9",
                                  ssm_step="96647d51b9a7"),
    "mamba.MambaBlock": dict(__call__="36611b5dd465", _process_sequence="60b89faa0460",
                             ssm_step="13b038d27950"),
}
_NORMS = ("dt_layernorm", "b_layernorm", "c_layernorm")
_LINEARS = ("in_proj", "x_proj", "dt_proj", "out_proj")


def form_of(module) -> str | None:
    """The :data:`FORMS` entry of ``module``'s exact class, or None."""
    return FORMS.get(class_key(base_class(module)))


def selective_scan_reason(module, dtype=None) -> str | None:
    """Why ``module`` cannot run the piece (None: it can): a class whose forward this piece
    does not follow, missing or unexpected parts."""
    cls = base_class(module)
    form = form_of(module)
    if form is None:
        return (f"{cls.__module__}.{cls.__name__}: a {MIXER} forward the patch does not know "
                f"(patched: {', '.join(FORMS)})")
    for name in _LINEARS:
        if not isinstance(module.get(name), nn.Module):
            return f"{name} is missing"
    for name in ("intermediate_size", "ssm_state_size", "time_step_rank", "conv_kernel_size"):
        v = getattr(module, name, None)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            return f"{name} is not a positive int"
    ch, N = module.intermediate_size, module.ssm_state_size
    r = depthwise_reason(module.get("conv1d"), ch, module.conv_kernel_size, "conv1d") or \
        conv_bias_reason(module.get("conv1d"), dtype, "conv1d")
    if r is not None:
        return r
    A_log, D = module.get("A_log"), module.get("D")
    if not isinstance(A_log, mx.array) or tuple(A_log.shape) != (ch, N):
        return f"A_log is not a ({ch}, {N}) array"
    if not isinstance(D, mx.array) or tuple(D.shape) != (ch,):
        return f"D is not a ({ch},) array"
    if form == "modules":
        for name in _NORMS:
            if not callable(module.get(name)):
                return f"{name} is missing"
    elif not isinstance(getattr(module, "use_bcdt_rms", None), bool):
        return "use_bcdt_rms is not a bool"
    elif module.use_bcdt_rms and not isinstance(
            getattr(getattr(module, "args", None), "mixer_rms_eps", None), float):
        return "args.mixer_rms_eps is not a float"
    if dtype is not None and dtype not in FLOAT_DTYPES:
        return f"input dtype {dtype_name(dtype)} is not float16/bfloat16/float32"
    return None


def state_dtype(m, x, dt, B, state, T):
    """The dtype of the state mlx-lm's loop leaves in the cache: jamba writes every token's
    state into its (delta x B) array; mamba adds ``state * exp(delta A)`` from the second
    token on (or the first, with a cached state), promoting with A's and the state's dtypes."""
    dtype = mx.result_type(x.dtype, dt.dtype, B.dtype)
    if form_of(m) == "modules" or (state is None and T < 2):
        return dtype
    return mx.result_type(dtype, m.A_log.dtype, dtype if state is None else state.dtype)


def prologue(m, x, cache, run, proj):
    """The module's computation up to its scan: ``in_proj`` (through ``proj``), the conv as a
    ``short_conv`` stage (its next state into ``cache[0]``), ``x_proj``, the norms and
    ``dt_proj``. Returns the kind's arguments and ``z``."""
    xs, z = mx.split(proj(m, "in_proj", x), 2, axis=-1)
    conv = m.conv1d
    xc, conv_state = run("conv", SHORT_CONV, {
        "x": xs, "weight": conv.weight, "bias": conv.get("bias"),
        "state": None if cache is None else cache[0], "mask": None, "activation": "silu"})
    if cache is not None:
        cache[0] = conv_state
    rank, N = m.time_step_rank, m.ssm_state_size
    delta, B, C = mx.split(proj(m, "x_proj", xc), [rank, rank + N], axis=-1)
    if form_of(m) == "modules":
        delta, B, C = m.dt_layernorm(delta), m.b_layernorm(B), m.c_layernorm(C)
    elif m.use_bcdt_rms:
        eps = m.args.mixer_rms_eps
        delta, B, C = (mx.fast.rms_norm(a, weight=None, eps=eps) for a in (delta, B, C))
    dt = proj(m, "dt_proj", delta)
    args = {"x": xc, "dt": dt, "A_log": m.A_log, "B": B, "C": C, "D": m.D,
            "state": None if cache is None else cache[1]}
    return args, z


class SelectiveScanPiece:
    """A Mamba-1 mixer as one piece (what ``mlx_bricks.nn.mixer.BricksMixer`` runs; the
    protocol is that module's docstring)."""

    name = MIXER
    role = "mamba"
    kind = SELECTIVE_SCAN_KIND
    bricks = (SHORT_CONV.op_name, SELECTIVE_SCAN_KIND.op_name)
    watched = ("conv1d", *_NORMS)
    call_names = ("cache",)
    #: The helpers of the forward this piece replaces, vetted with it (``patch.modules``).
    helpers = ("_process_sequence", "ssm_step")
    #: The forwards and helpers this piece follows (mlx-lm 0.32.2).
    vetted = tuple(f"mlx_lm.models.{c}.{f}={d}" for c, fs in _VETTED.items()
                   for f, d in fs.items())

    def matches(self, module) -> bool:
        """Whether ``module`` is a Mamba-1 mixer (known to the piece or not): a class with an
        ``ssm_step`` named Mamba-something, or derived from one."""
        cls = base_class(module)
        return callable(getattr(cls, "ssm_step", None)) and any(
            "Mamba" in c.__name__ for c in cls.__mro__)

    def reason(self, module, layout=None, dtype=None) -> str | None:
        return selective_scan_reason(module, dtype)

    def prior_saving(self, module, backend: str) -> float:
        """Seconds per prompt token this mixer's prefill saves on ``backend`` once warm
        (``tune.prior.saved_s_per_token``; ``kind.SAVED_S_PER_TOKEN_STATE`` per state element:
        channels x N), 0 where nothing was measured."""
        from mlx_bricks.bricks.selective_scan.kind import SAVED_S_PER_TOKEN_STATE

        return (SAVED_S_PER_TOKEN_STATE.get(backend, 0.0) * module.intermediate_size
                * module.ssm_state_size)

    def call_reason(self, module, inputs, call) -> str | None:
        """Why this call's cache is not one the piece writes as the module does (None: it
        is): an ``ArraysCache`` of (conv, recurrent) states or None."""
        return arrays_cache_reason(call["cache"], 2, "conv, recurrent")

    def shape_key(self, module, inputs, call) -> tuple:
        cache = call["cache"]
        return (inputs.shape, inputs.dtype, cache is None,
                cache is not None and cache[1] is not None)

    def stage_names(self, module, dtype) -> tuple[str, ...]:
        """The projections that run as ``linear`` stages (``bricks.gemm.piece.stage_names``)."""
        from mlx_bricks.bricks.gemm.piece import stage_names

        return stage_names(module, _LINEARS, dtype)

    def stages(self, module, inputs, call) -> dict:
        """The stages around the scan: ``{"conv": (short_conv kind, its arguments as
        shapes)}`` and the ``linear`` stages of :meth:`stage_names`, each with its input's
        shape."""
        from mlx_bricks.bricks.gemm import piece as linear_piece
        from mlx_bricks.runtime.kind import Act

        b, T, _ = inputs.shape
        cache = call["cache"]
        conv = module.conv1d
        ch, dt = module.intermediate_size, inputs.dtype
        state = None if cache is None else cache[0]
        widths = {"in_proj": inputs.shape[-1], "x_proj": ch,
                  "dt_proj": module.time_step_rank, "out_proj": ch}
        return {"conv": (SHORT_CONV, {
            "x": Act((b, T, ch), dt), "weight": conv.weight, "bias": conv.get("bias"),
            "state": None if state is None else Act(tuple(state.shape), state.dtype),
            "mask": None, "activation": "silu"}),
            **{n: (linear_piece.KIND, linear_piece.linear_args(
                module[n], Act((b, T, widths[n]), dt)))
               for n in self.stage_names(module, dt)}}

    def placeholders(self, module, inputs, call) -> dict:
        """The kind's arguments as shapes (``runtime.kind.Act``) for the dispatcher's key."""
        from mlx_bricks.runtime.kind import Act

        b, T, _ = inputs.shape
        cache = call["cache"]
        ch, N, dt = module.intermediate_size, module.ssm_state_size, inputs.dtype
        state = None if cache is None else cache[1]
        return {"x": Act((b, T, ch), dt), "dt": Act((b, T, ch), dt), "A_log": module.A_log,
                "B": Act((b, T, N), dt), "C": Act((b, T, N), dt), "D": module.D,
                "state": None if state is None else Act(tuple(state.shape), state.dtype)}

    def prologue(self, module, inputs, call, run):
        from mlx_bricks.bricks.gemm.piece import projector

        proj = projector(self.stage_names(module, inputs.dtype), run)
        args, z = prologue(module, inputs, call["cache"], run, proj)
        return args, (args, z, proj)

    def epilogue(self, module, out, ctx, inputs, call):
        """The recurrent state into ``cache[1]`` in stock's dtype, y in stock's dtype (mamba's
        may be promoted by a float32 A), ``out_proj(swiglu(z, y))``."""
        from mlx_lm.models.activations import swiglu

        y, state = out
        args, z, proj = ctx
        cache = call["cache"]
        sdt = state_dtype(module, args["x"], args["dt"], args["B"], args["state"],
                          inputs.shape[1])
        if cache is not None:
            cache[1] = state.astype(sdt)
        ydt = mx.result_type(sdt, args["C"].dtype, args["D"].dtype, args["x"].dtype)
        return proj(module, "out_proj", swiglu(z, y.astype(ydt)))

    def linears(self, layout=None, module=None) -> tuple[str, ...]:
        """The linear layers the piece reads (structure fingerprint)."""
        return _LINEARS


SELECTIVE_SCAN_PIECE = SelectiveScanPiece()
