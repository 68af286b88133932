"""The SSD brick's piece in a patched mlx-lm model: a Mamba-2 mixer module whose prefill runs its
in-projection (a ``linear`` stage on the GEMM brick where the dispatch chooses it, else its own
layer), its causal conv1d + SiLU as a ``short_conv`` stage (the short-conv brick or mlx-lm's
ops, as the tuner decides; the conv state written to the cache as the module's ``_conv``
writes it), then the brick's scan (:data:`~mlx_bricks.bricks.ssd.kind.SSD_KIND`) instead of
``ssm_update``, then its own gated norm and out-projection (a stage too); the recurrent state
and the offset are written as the module writes them.

The forms this piece follows (mlx-lm 0.32.2; :data:`FORMS`): mamba2 ``Mamba2Block``,
nemotron_h ``NemotronHMamba2Mixer``, granitemoehybrid ``GraniteMoeHybridMamba2Mixer``,
falcon_h1 ``FalconH1Mixer`` (its call is ``(x, cache, mask)``: :data:`FALCON_SSD_PIECE`) and
plamo2 ``Mamba`` (B, C and dt from their own projection and RMSNorms). Each form is vetted by
its ``__call__`` and by the helpers the piece replaces (``_conv``; ``_ssm``: whether it
casts D, passes the cache's lengths); any other module whose forward calls ``ssm_update``
stays stock with the reason. jamba's ``JambaMambaMixer`` is Mamba-1 (a selective scan with A
per channel and state entry, no ``ssm_update``): the selective-scan brick's piece.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.bricks.short_conv.kind import SHORT_CONV
from mlx_bricks.bricks.short_conv.piece import conv_bias_reason, depthwise_reason
from mlx_bricks.bricks.ssd.kind import SSD_KIND
from mlx_bricks.bricks.ssd.op import DEFAULT_TIME_STEP_LIMIT
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.runtime.scan import arrays_cache_reason, mask_reason
from mlx_bricks.runtime.classes import base_class, class_key

#: The mixer's name in reports.
MIXER = "Mamba-2 (SSD)"


@dataclass(frozen=True)
class Form:
    """How a known Mamba-2 mixer class computes around ``ssm_update`` (read in mlx-lm 0.32.2).

    Attributes:
        helpers: vetted fingerprints (``patch.vetted``) of the ``_conv`` and ``_ssm`` the
            piece replaces.
        cast_D: ``_ssm`` passes ``D.astype(x.dtype)`` (else D as stored).
        lengths: ``_ssm`` passes the cache's ``lengths`` (right-padded batches).
        plamo2: plamo2's forward: ``in_proj`` gives (z, x) per head, B, C and dt come from
            ``bcdt_proj`` of the conv output, RMS-normalised, dt through ``dt_proj``; one
            group; mlx-lm's default time-step limit.
        epilogue: ``"norm"`` (``norm(y, gate)``), ``"falcon"`` (``norm(y, gate)`` with
            ``mamba_rms_norm``, else ``swiglu(gate, y)``) or ``"swiglu"`` (plamo2:
            ``swiglu(z, y)``).
    """

    helpers: tuple[str, ...]
    cast_D: bool = False
    lengths: bool = True
    plamo2: bool = False
    epilogue: str = "norm"


def _fp(cls: str, **digests: str) -> tuple[str, ...]:
    return tuple(f"mlx_lm.models.{cls}.{f}={d}" for f, d in digests.items())


#: ``"<module>.<Class>"`` -> its form.
FORMS: dict[str, Form] = {
    "mamba2.Mamba2Block": Form(_fp("mamba2.Mamba2Block", _conv="7d70a98554ea",
                                   _ssm="6339ee7af104")),
    "nemotron_h.NemotronHMamba2Mixer": Form(
        _fp("nemotron_h.NemotronHMamba2Mixer", _conv="7d70a98554ea", _ssm="52072e6fe8d1"),
        cast_D=True, lengths=False),
    "granitemoehybrid.GraniteMoeHybridMamba2Mixer": Form(
        _fp("granitemoehybrid.GraniteMoeHybridMamba2Mixer", _conv="7d70a98554ea",
            _ssm="c3b7973595fc"), cast_D=True),
    "falcon_h1.FalconH1Mixer": Form(_fp("falcon_h1.FalconH1Mixer", _conv="7d70a98554ea",
                                        _ssm="6339ee7af104"), epilogue="falcon"),
    "plamo2.Mamba": Form(_fp("plamo2.Mamba", _conv="2ab0c524a51c", _ssm="3c7f281265f2"),
                         plamo2=True, epilogue="swiglu"),
}


def form_of(module) -> Form | None:
    """The :data:`FORMS` entry of ``module``'s exact class, or None."""
    return FORMS.get(class_key(base_class(module)))


def calls_ssm_update(module) -> bool:
    """Whether ``module``'s class (or a class it derives from) refers to mlx-lm's
    ``ssm_update`` in its ``__call__`` or its ``_ssm`` (the names among their code's globals):
    a Mamba-2 mixer, known or not."""
    for cls in base_class(module).__mro__:  # an override of _ssm is still a Mamba-2 mixer
        for name in ("__call__", "_ssm"):
            code = getattr(cls.__dict__.get(name), "__code__", None)
            if code is not None and "ssm_update" in (*code.co_names, *code.co_freevars):
                return True
    return False


def _ints_reason(module, names) -> str | None:
    for name in names:
        v = getattr(module, name, None)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            return f"{name} is not a positive int"
    return None


def ssd_reason(module, dtype=None) -> str | None:
    """Why ``module`` cannot run the SSD piece (None: it can): a class whose forward this piece
    does not follow (a subclass included), helpers other than the vetted ones, missing or
    unexpected parts."""
    cls = base_class(module)
    form = form_of(module)
    if form is None:
        return (f"{cls.__module__}.{cls.__name__}: a {MIXER} forward the patch does not know "
                f"(patched: {', '.join(FORMS)})")
    linears = ("in_proj", "bcdt_proj", "dt_proj", "out_proj") if form.plamo2 else \
        ("in_proj", "out_proj")
    for name in linears:
        if not isinstance(module.get(name), nn.Module):
            return f"{name} is missing"
    conv = module.get("conv1d")
    channels = getattr(module, "intermediate_size" if form.plamo2 else "conv_dim", None)
    K = getattr(module, "conv_kernel_size", None)
    if not isinstance(channels, int) or not isinstance(K, int):
        return "conv_dim or conv_kernel_size is not an int"
    r = depthwise_reason(conv, channels, K, "conv1d") or conv_bias_reason(conv, dtype, "conv1d")
    if r is not None:
        return r
    if form.plamo2:
        r = _ints_reason(module, ("num_heads", "hidden_size_per_head", "d_state",
                                  "conv_kernel_size"))
        heads, groups = getattr(module, "num_heads", 0), 1
    else:
        r = _ints_reason(module, ("num_heads", "head_dim", "n_groups", "ssm_state_size",
                                  "intermediate_size", "conv_dim", "conv_kernel_size"))
        heads, groups = getattr(module, "num_heads", 0), getattr(module, "n_groups", 1)
    if r is not None:
        return r
    if heads % groups:
        return f"num_heads {heads} is not a multiple of n_groups {groups}"
    for name in ("A_log", "D", "dt_bias"):
        a = module.get(name)
        if not isinstance(a, mx.array) or tuple(a.shape) != (heads,):
            return f"{name} is not a ({heads},) array"
    if form.epilogue == "norm" or (form.epilogue == "falcon" and
                                   getattr(module, "mamba_rms_norm", False)):
        if not callable(module.get("norm")):
            return "norm is missing"
    if not form.plamo2:
        limit = getattr(module, "time_step_limit", None)
        if not (isinstance(limit, (tuple, list)) and len(limit) == 2):
            return "time_step_limit is not a (lo, hi) pair"
    if dtype is not None and dtype not in FLOAT_DTYPES:
        return f"input dtype {dtype_name(dtype)} is not float16/bfloat16/float32"
    return None


def cache_reason(cache, mask) -> str | None:
    """Why the call's cache is not one the piece writes as the module does (None: it is)."""
    reason = arrays_cache_reason(cache, 2, "conv, recurrent")
    if reason is None and cache is not None and cache.lengths is not None and mask is None:
        return "the cache has lengths but the call no mask: padded tokens would not be masked"
    return reason


def _dims(m, form) -> tuple[int, int, int, int]:
    """``(H, P, G, N)`` of mixer ``m``."""
    if form.plamo2:
        return m.num_heads, m.hidden_size_per_head, 1, m.d_state
    return m.num_heads, m.head_dim, m.n_groups, m.ssm_state_size


def conv_stage(m, conv_input, mask, cache, run):
    """The module's ``_conv`` as a ``short_conv`` stage: mask, the cache's conv state (zeros
    without one), the depthwise conv, bias and SiLU; the next conv state written to the cache
    (``lengths`` honoured) as ``_conv`` writes it. ``run(role, kind, args)`` runs the stage."""
    conv = m.conv1d
    args = {"x": conv_input, "weight": conv.weight, "bias": conv.get("bias"),
            "state": None if cache is None else cache[0], "mask": mask, "activation": "silu",
            "lengths": None if cache is None else cache.lengths}
    y, state = run("conv", SHORT_CONV, args)
    if cache is not None:
        cache[0] = state
    return y


def prologue(m, x, mask, cache, run, proj):
    """The module's own computation up to ``ssm_update`` (module docstring), its conv run as a
    stage (:func:`conv_stage`), ``in_proj`` through ``proj(m, name, x)`` (a ``linear`` stage
    or the module's own layer): returns the kind's arguments and the output gate (``gate``;
    plamo2: ``z``)."""
    form = form_of(m)
    b, T, _ = x.shape
    H, P, G, N = _dims(m, form)
    if form.plamo2:
        z, xs = mx.split(proj(m, "in_proj", x).reshape(b, T, H, -1), [P], axis=-1)
        xs = conv_stage(m, xs.reshape(b, -1, H * P), mask, cache, run)
        Bm, Cm, dt = mx.split(m.bcdt_proj(xs), [N, 2 * N], axis=-1)
        eps = m.config.rms_norm_eps
        dt = m.dt_proj(mx.fast.rms_norm(dt, m.dt_norm_weight, eps))
        Bm = mx.fast.rms_norm(Bm, m.B_norm_weight, eps)
        Cm = mx.fast.rms_norm(Cm, m.C_norm_weight, eps)
        gate, limit = z.flatten(-2), DEFAULT_TIME_STEP_LIMIT
    else:
        inner = m.intermediate_size
        gate, conv_input, dt = mx.split(proj(m, "in_proj", x), [inner, inner + m.conv_dim],
                                        axis=-1)
        conv_output = conv_stage(m, conv_input, mask, cache, run)
        xs, Bm, Cm = mx.split(conv_output, [inner, inner + G * N], axis=-1)
        limit = tuple(m.time_step_limit)
    if cache:
        state, lengths = cache[1], cache.lengths if form.lengths else None
    else:
        state, lengths = None, None
    D = m.D.astype(xs.dtype) if form.cast_D else m.D
    args = {"x": xs.reshape(b, T, H, P), "dt": dt, "A_log": m.A_log,
            "B": Bm.reshape(b, T, G, N), "C": Cm.reshape(b, T, G, N), "D": D,
            "dt_bias": m.dt_bias, "state": state, "mask": mask, "lengths": lengths,
            "time_step_limit": limit}
    return args, gate


def epilogue(m, y, state, gate, cache, T, proj):
    """The module's own computation after ``ssm_update``: the recurrent state and offset into
    the cache, the gated norm, the out-projection (through ``proj``, as in :func:`prologue`)."""
    form = form_of(m)
    if cache:
        cache[1] = state
    y = y.reshape(y.shape[0], T, -1)
    if cache:
        cache.advance(T)
    if form.epilogue == "norm" or (form.epilogue == "falcon" and m.mamba_rms_norm):
        y = m.norm(y, gate)
    else:
        from mlx_lm.models.activations import swiglu

        y = swiglu(gate, y)
    return proj(m, "out_proj", y)


class SSDPiece:
    """A Mamba-2 mixer as one piece (what ``mlx_bricks.nn.mixer.BricksMixer`` runs; the protocol
    is that module's docstring).

    Attributes:
        call_names: the module's call arguments after the input (falcon_h1: ``("cache",
            "mask")``); the input may come by keyword ``input_name`` (plamo2 and falcon_h1
            layers call their mixer by keywords).
        classes: the :data:`FORMS` this instance patches (None: every form but those of
            another instance, and the unknown Mamba-2 mixers, reported stock).
    """

    name = MIXER
    role = "mamba"
    kind = SSD_KIND
    bricks = (SHORT_CONV.op_name, SSD_KIND.op_name)
    watched = ("conv1d", "norm")

    def __init__(self, call_names=("mask", "cache"), classes=None,
                 input_name="hidden_states"):
        self.call_names = tuple(call_names)
        self.classes = classes
        self.input_name = input_name

    #: The helpers of the forward this piece replaces, vetted with it (``patch.modules``).
    helpers = ("_conv", "_ssm")

    @property
    def vetted(self) -> tuple[str, ...]:
        """The forwards (and their helpers, :data:`FORMS`) this piece follows
        (``patch.vetted`` fingerprints, mlx-lm 0.32.2)."""
        digests = {"mamba2.Mamba2Block": "de7ab88f6c2e",
                   "nemotron_h.NemotronHMamba2Mixer": "ef7ea03055f4",
                   "granitemoehybrid.GraniteMoeHybridMamba2Mixer": "ef7ea03055f4",
                   "falcon_h1.FalconH1Mixer": "c93f12d055e1", "plamo2.Mamba": "387b9d02e72f"}
        return tuple(fp for c, d in digests.items()
                     if self.classes is None or c in self.classes
                     for fp in (f"mlx_lm.models.{c}.__call__={d}", *FORMS[c].helpers))

    def matches(self, module) -> bool:
        """Whether ``module`` is a Mamba-2 mixer this instance is about (known to it or not)."""
        if not calls_ssm_update(module):
            return False
        if self.classes is None:
            return True
        names = {class_key(c) for c in base_class(module).__mro__}
        return not names.isdisjoint(self.classes)

    def call_reason(self, module, inputs, call) -> str | None:
        """Why this call's mask or cache is not one the piece follows (None: it is)."""
        return mask_reason(call["mask"], inputs) or cache_reason(call["cache"], call["mask"])

    def shape_key(self, module, inputs, call) -> tuple:
        cache = call["cache"]
        return (inputs.shape, inputs.dtype, call["mask"] is not None, cache is None,
                bool(cache) and cache[1] is not None)

    def stage_names(self, module, dtype) -> tuple[str, ...]:
        """The projections that run as ``linear`` stages: ``in_proj`` and ``out_proj`` where
        ``bricks.gemm.piece.stage_names`` takes them (plamo2's small ``bcdt_proj`` and
        ``dt_proj`` stay the module's own)."""
        from mlx_bricks.bricks.gemm.piece import stage_names

        return stage_names(module, ("in_proj", "out_proj"), dtype)

    def stages(self, module, inputs, call) -> dict:
        """The stages around the scan: ``{"conv": (short_conv kind, its arguments as
        shapes)}``, and the ``linear`` stages of :meth:`stage_names` (``out_proj`` reads the
        scan's (b, T, H * P) output)."""
        from mlx_bricks.bricks.gemm import piece as linear_piece
        from mlx_bricks.runtime.kind import Act

        mask, cache = call["mask"], call["cache"]
        b, T, _ = inputs.shape
        conv = module.conv1d
        C, K = conv.weight.shape[:2]
        state = None if cache is None else cache[0]
        H, P, _, _ = _dims(module, form_of(module))
        x = Act(tuple(inputs.shape), inputs.dtype)
        return {"conv": (SHORT_CONV, {
            "x": Act((b, T, C), inputs.dtype), "weight": conv.weight, "bias": conv.get("bias"),
            "state": None if state is None else Act(tuple(state.shape), state.dtype),
            "mask": None if mask is None else Act((b, T), mx.bool_), "activation": "silu"}),
            **{n: (linear_piece.KIND, linear_piece.linear_args(
                module[n], Act((b, T, H * P), inputs.dtype) if n == "out_proj" else x))
               for n in self.stage_names(module, inputs.dtype)}}

    def prologue(self, module, inputs, call, run):
        from mlx_bricks.bricks.gemm.piece import projector

        proj = projector(self.stage_names(module, inputs.dtype), run)
        args, gate = prologue(module, inputs, call["mask"], call["cache"], run, proj)
        return args, (gate, proj)

    def epilogue(self, module, out, ctx, inputs, call):
        y, state = out
        gate, proj = ctx
        return epilogue(module, y, state, gate, call["cache"], inputs.shape[1], proj)

    def linears(self, layout=None, module=None) -> tuple[str, ...]:
        """The linear layers the piece reads (structure fingerprint)."""
        return ("in_proj", "bcdt_proj", "dt_proj", "out_proj")

    def reason(self, module, layout=None, dtype=None) -> str | None:
        return ssd_reason(module, dtype)

    def prior_saving(self, module, backend: str) -> float:
        """Seconds per prompt token this mixer's prefill saves on ``backend`` once warm
        (``tune.prior.saved_s_per_token``; ``kind.SAVED_S_PER_TOKEN_STATE`` per state element:
        H x P x N), 0 where nothing was measured."""
        from mlx_bricks.bricks.ssd.kind import SAVED_S_PER_TOKEN_STATE

        H, P, _, N = _dims(module, form_of(module))
        return SAVED_S_PER_TOKEN_STATE.get(backend, 0.0) * H * P * N

    def placeholders(self, module, inputs, call) -> dict:
        """The kind's arguments as shapes (``runtime.kind.Act``) for the dispatcher's key."""
        from mlx_bricks.runtime.kind import Act

        form = form_of(module)
        mask, cache = call["mask"], call["cache"]
        b, T, _ = inputs.shape
        H, P, G, N = _dims(module, form)
        dt = inputs.dtype
        state = cache[1] if cache else None
        return {"x": Act((b, T, H, P), dt), "dt": Act((b, T, H), dt), "A_log": module.A_log,
                "B": Act((b, T, G, N), dt), "C": Act((b, T, G, N), dt),
                "D": module.D.astype(dt) if form.cast_D else module.D,
                "dt_bias": module.dt_bias,
                "state": None if state is None else Act(tuple(state.shape), state.dtype),
                "mask": None if mask is None else Act((b, T), mx.bool_),
                "time_step_limit": (DEFAULT_TIME_STEP_LIMIT if form.plamo2
                                    else tuple(module.time_step_limit))}


#: falcon_h1's mixer (called ``(input_states, cache, mask)``).
FALCON_SSD_PIECE = SSDPiece(call_names=("cache", "mask"), classes=("falcon_h1.FalconH1Mixer",),
                            input_name="input_states")
#: Every other Mamba-2 mixer (called ``(hidden_states, mask, cache)``).
SSD_PIECE = SSDPiece()
