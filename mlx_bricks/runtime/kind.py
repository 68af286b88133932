"""Op kinds: what the dispatch and the tuner know of a brick, through one interface.

An op kind (:class:`OpKind`, one per brick op the patch runs, defined in the brick's
``kind.py`` and registered with :func:`register_kind`) gives, for one call's arguments: its
decision key (:class:`Key`), the stock MLX / mlx-lm computation it replaces, its candidate
:class:`Variant` objects (kernel variants from the brick's own listing function, and
composites of stock MLX ops the brick registers), synthetic inputs for timing, and the
high-precision reference of the numeric check. The dispatch (``runtime.dispatch``) and the
tuner (``tune.tuner``) use nothing else; neither knows a kind by name.

Arguments travel as one ``dict`` per call, named as the op names them (``x``, ``weight``, ``q``,
...). An activation that does not exist yet when a decision is taken (the patch decides every
piece of a block before running it) may be an :class:`Act` placeholder with its shape and dtype;
keys and synthetic inputs need nothing else.
"""
from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from mlx_bricks.tune.check import CloseResult, dtype_close, worst

#: Output rows (the last ones) the numeric check compares: the reference is computed for these
#: only, so its cost does not grow with M. The last rows see every key under a causal mask.
CHECK_ROWS = 8


@dataclass(frozen=True)
class Act:
    """Placeholder for an activation that is not computed yet: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: object

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Key:
    """What a decision is keyed by (besides device, versions and backend: ``cache.Context``).

    Attributes:
        kind: op kind name (``OpKind.name``).
        params: the op's fixed shape parameters, e.g. ``"N=4096,K=4096,bias=0,res=1"``.
        bucket: the varying sizes' bucket (``tune.buckets.m_bucket`` / ``attention_bucket``).
        dtype: activation dtype name (``float16``, ...).
        weights: weight format (``formats.formats_key``: ``float``, ``q<bits>g<group_size>``,
            or each weight's joined by ``/`` when they differ; ``-`` for attention).
    """

    kind: str
    params: str
    bucket: str
    dtype: str
    weights: str

    def __str__(self) -> str:
        return f"{self.kind}[{self.params}] {self.bucket} {self.dtype} w={self.weights}"

    @property
    def scope(self) -> str:
        """What a variant the guard disables is disabled for besides backend, kind and name:
        everything in the key but the shape bucket, i.e. the op's fixed shape parameters
        (head_dim, N, K...), the dtype and the weight format. A kernel is built per template
        instantiation: a float16 build error, a tile too large for 8-bit weights or a head_dim
        a twin lacks says nothing about the other instantiations."""
        return f"{self.kind}[{self.params}] {self.dtype} w={self.weights}"


@dataclass(frozen=True)
class Variant:
    """One candidate implementation of an op kind: ``run(args, backend)`` computes it.

    Attributes:
        name: the variant's name (a tile such as ``"64x64"``, a SwiGLU variant ``"fused"``, a
            composite such as ``"dequant"``).
        kwargs: keyword arguments that select a kernel variant in the brick op
            (``{"tile": "64x64"}``); what a decision records.
        fn: ``fn(args, backend) -> output``; :meth:`OpKind.variant` binds a kernel variant to
            the brick op, a composite is the brick's own function, tests inject theirs. None:
            the kind that runs it (:meth:`OpKind.run`) calls its brick with ``kwargs``.
        builds: running it compiles a kernel in the process (on ``metal`` / ``cuda``): a
            kernel variant, or a composite that calls a brick; False for a composite of stock
            MLX ops (``tune.prior`` weighs the build against the gain).
        cuda_kernels: the registered kernels it launches on ``cuda`` (:attr:`OpKind.
            cuda_kernels` for a kernel variant); the dispatch asks the CUDA build cache whether
            each is compiled on this machine (``kernels.is_built``). Empty: not known, counted
            as not built.
    """

    name: str
    kwargs: dict = field(default_factory=dict)
    fn: Callable | None = field(default=None, compare=False)
    builds: bool = field(default=True, compare=False)
    cuda_kernels: tuple[str, ...] = field(default=(), compare=False)

    def run(self, args: dict, backend: str):
        """The variant's output for ``args`` on ``backend``.

        Raises:
            TypeError: an unbound variant (no ``fn``): run it through its kind.
        """
        if self.fn is None:
            raise TypeError(f"variant {self.name!r} is not bound to an op; use OpKind.run")
        return self.fn(args, backend)


@dataclass(frozen=True)
class Composite:
    """A variant made of stock MLX ops that a brick registers beside its kernels (e.g.
    "dequantize the weight, then the stock float GEMM"): it runs on every backend it applies
    to, the CPU included, and the tuner weighs it against stock like any kernel variant.

    Attributes:
        name: the variant name.
        fn: ``fn(args, backend, settings) -> output``; ``settings``: the kind's settings from
            the dispatch (the patch's per-kind settings and its common ones, e.g. the
            dequantize cap; ``{}`` outside a patch).
        applies: ``applies(args, backend) -> bool``: whether it computes these arguments on
            this backend (e.g. only quantized weights); default always.
        kwargs: what it records in a decision and what ``OpKind.restrict`` may select on,
            as a kernel variant's keyword arguments (e.g. the SwiGLU style it computes).
        builds: it calls a brick kernel (compiled in the process on ``metal`` / ``cuda``);
            default False: stock MLX ops only.
        cuda_kernels: the registered kernels it launches on ``cuda`` (as
            :attr:`Variant.cuda_kernels`).
    """

    name: str
    fn: Callable
    applies: Callable = field(default=lambda args, backend: True, compare=False)
    kwargs: dict = field(default_factory=dict, compare=False)
    builds: bool = field(default=False, compare=False)
    cuda_kernels: tuple[str, ...] = field(default=(), compare=False)

    def bind(self, settings: dict) -> Variant:
        """The composite as a :class:`Variant` computing with ``settings``."""
        return Variant(self.name, dict(self.kwargs),
                       functools.partial(_run_composite, self.fn, dict(settings)),
                       builds=self.builds, cuda_kernels=self.cuda_kernels)


def _run_composite(fn, settings, args, backend):
    return fn(args, backend, settings)


@contextlib.contextmanager
def high_precision(dtype):
    """Yields the reference dtype: float32 for float16/bfloat16 inputs (its rounding error is
    about 2^-24, far below theirs), float64 on the CPU for float32 inputs (GPUs have none)."""
    if dtype == mx.float32:
        with mx.stream(mx.cpu):
            yield mx.float64
    else:
        yield mx.float32


def flags(**values) -> str:
    """A key's ``params`` string: ``"N=4096,K=4096,bias=0"`` (bools as 0/1)."""
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in values.items())


def check_rows(n: int) -> int:
    """Rows the numeric check compares for an output of ``n`` rows (1 .. CHECK_ROWS)."""
    return max(1, min(CHECK_ROWS, n))


class OpKind:
    """One op kind (module docstring). A brick subclasses it and fills in its parts: ``key``,
    ``brick``, ``stock``, ``listing``, ``variant_kwargs``, ``n_rows``, ``tail``,
    ``reference_tail``; optionally ``composites``, ``rule_kwargs``, ``restrict``,
    ``settings_suffix``, ``untuned_reason``, ``measured``.

    Attributes:
        name: the kind's name in decision keys and the guard.
        op_name: the brick op it runs, as the patch report counts its calls.
        activations: argument names that are activations (synthesised for timing, sliced for
            the check).
        composites: composites of stock MLX ops the brick offers beside its kernels.
        cuda_kernels: the registered kernels its kernel variants launch on ``cuda`` (every
            one a variant may launch: a variant counts as built only when all are).
    """

    name = ""
    op_name = ""
    activations: tuple[str, ...] = ()
    composites: tuple[Composite, ...] = ()
    cuda_kernels: tuple[str, ...] = ()

    # --- what the brick fills in -----------------------------------------------------------

    def key(self, args: dict) -> Key:
        raise NotImplementedError

    def dtype(self, args: dict):
        return args[self.activations[0]].dtype

    def brick(self, args: dict, backend: str, **kwargs):
        """The brick op on the resolved ``backend`` with variant keyword arguments ``kwargs``
        (arguments already valid: the patch checked the module's structure)."""
        raise NotImplementedError

    def stock(self, args: dict):
        """The stock MLX / mlx-lm computation of the same values."""
        raise NotImplementedError

    def listing(self, backend: str, dtype, args: dict | None) -> tuple[str, ...]:
        """The brick's own listing of its kernel variants on ``backend`` for activations of
        ``dtype`` and (given ``args``) their weight formats: a CUDA tile may not take every
        width."""
        raise NotImplementedError

    def variant_kwargs(self, name: str) -> dict:
        """The op keyword arguments that select kernel variant ``name``."""
        raise NotImplementedError

    def rule_kwargs(self, args: dict, settings: dict) -> dict:
        """Keyword arguments of the untuned choice (the brick's own rules); ``settings``: the
        patch's settings for this kind (e.g. the SwiGLU variant asked for)."""
        return {}

    def restrict(self, variants: list[Variant], settings: dict) -> list[Variant]:
        """The candidates the tuner may weigh under ``settings`` (default: all)."""
        return variants

    def settings_suffix(self, settings: dict) -> str:
        """What ``settings`` add to a decision's cache key (default: nothing)."""
        return ""

    def prior(self, args: dict, backend: str) -> str | None:
        """The variant (by name; a no-build composite) or ``"stock"`` that ``tune="cached"``
        runs for ``args`` on ``backend`` when nothing was measured, from this brick's own
        measurements; None (default): the generic rules of ``tune.prior``."""
        return None

    def untuned_reason(self, args: dict) -> str | None:
        """Why this call is never tuned but runs the brick by its rules (e.g. a requested
        change of the values that no stock op computes), or None."""
        return None

    def measured(self, args: dict) -> dict:
        """The shapes a timing of ``args`` runs at, for the decision's record."""
        return {"rows": self.n_rows(args)}

    def n_rows(self, args: dict) -> int:
        raise NotImplementedError

    def tail(self, out, rows: int):
        """The last ``rows`` output rows (what :meth:`reference_tail` computes)."""
        raise NotImplementedError

    def reference_tail(self, args: dict, rows: int):
        """The last ``rows`` output rows in high precision (:func:`high_precision`)."""
        raise NotImplementedError

    # --- generic ---------------------------------------------------------------------------

    def variant(self, name: str, kwargs: dict | None = None) -> Variant:
        """Kernel variant ``name`` bound to the brick op (``kwargs``: default
        :meth:`variant_kwargs` of the name)."""
        kw = self.variant_kwargs(name) if kwargs is None else dict(kwargs)
        return Variant(name, kw, functools.partial(self._run_brick, kw),
                       cuda_kernels=self.cuda_kernels)

    def _run_brick(self, kwargs, args, backend):
        return self.brick(args, backend, **kwargs)

    def variants(self, backend: str, dtype=None, args: dict | None = None, *,
                 names: tuple[str, ...] | None = None,
                 settings: dict | None = None) -> list[Variant]:
        """The candidates on ``backend`` for ``dtype`` (and, given ``args``, for their weight
        formats): the kernel variants of the brick's listing (``names`` if the caller has
        it), then the composites that apply to ``args`` on ``backend``, bound to
        ``settings`` (the dispatch's for this kind)."""
        if names is None:
            names = self.listing(backend, dtype, args)
        out = [self.variant(n) for n in names]
        if args is not None:
            out += [c.bind(settings or {}) for c in self.composites if c.applies(args, backend)]
        return out

    def run(self, variant: Variant, args: dict, backend: str):
        """Output of ``variant`` (its ``fn``, or the brick op with its kwargs)."""
        if variant.fn is not None:
            return variant.fn(args, backend)
        return self.brick(args, backend, **variant.kwargs)

    def synthetic(self, args: dict, seed: int = 0) -> dict:
        """``args`` with every activation replaced by standard-normal values of its shape and
        dtype (weights, scalars and options kept): the inputs the tuner times."""
        out = dict(args)
        names = [n for n in self.activations if args.get(n) is not None]
        keys = mx.random.split(mx.random.key(seed), max(2, len(names)))
        for n, k in zip(names, keys):
            out[n] = mx.random.normal(tuple(args[n].shape), key=k).astype(args[n].dtype)
        return out

    def check_call(self, args: dict) -> dict:
        """The arguments the first-call check (``runtime.guard``) runs the variant, stock and
        the reference on: ``args`` itself (default), or a cheaper call whose output is a part of
        this one's (a causal recurrence's first tokens), where checking the whole call would
        cost more than the call."""
        return args

    def check_stock(self, args: dict):
        """Stock's output for :meth:`check` on ``args``: as much of it as :meth:`tail` reads
        (default: all of it, :meth:`stock`)."""
        return self.stock(args)

    def check(self, out, naive, args: dict) -> CloseResult:
        """The tolerance rule for ``out`` against stock's ``naive`` output on the same ``args``
        (real arrays), on the last :data:`CHECK_ROWS` rows; ``naive`` None where stock failed
        to run (``tune.check.dtype_close``: the reference rounded to the dtype instead)."""
        rows = check_rows(self.n_rows(args))
        refs = self.reference_tail(args, rows)
        dtype = self.dtype(args)
        outs = self.tail(out, rows)
        if naive is None:
            naives = (None,) * len(outs) if isinstance(outs, tuple) else None
        else:
            naives = self.tail(naive, rows)
        if isinstance(outs, tuple):
            return worst([dtype_close(o, r, n, dtype=dtype)
                          for o, n, r in zip(outs, naives, refs)])
        return dtype_close(outs, refs, naives, dtype=dtype)


class TokenRowsKind(OpKind):
    """A kind whose rows are the tokens of ``x`` (all leading axes flattened): the GEMM
    family."""

    def n_rows(self, args):
        return math.prod(args["x"].shape[:-1])

    def tail(self, out, rows):
        return out.reshape(-1, out.shape[-1])[-rows:]

    def measured(self, args):
        return {"M": self.n_rows(args)}

    def check_stock(self, args):
        """Stock on the last :func:`check_rows` rows only (rows are independent: each
        activation's last rows, as :meth:`tail` reads them): the check then costs a few rows of
        stock, not a second full GEMM."""
        rows = check_rows(self.n_rows(args))
        cut = dict(args)
        for n in self.activations:
            a = args.get(n)
            if a is not None:
                cut[n] = a.reshape(-1, a.shape[-1])[-rows:]
        return self.stock(cut)


#: The registered op kinds by name (filled as the bricks' ``kind`` modules are imported;
#: ``mlx_bricks.bricks.kinds()`` imports them all).
KINDS: dict[str, OpKind] = {}


def register_kind(kind: OpKind) -> OpKind:
    """Register ``kind`` under ``kind.name`` (what a brick's ``kind.py`` does at import, as
    ``kernels.register`` for kernels). Returns ``kind``.

    Raises:
        ValueError: no name, or another kind object already has the name.
    """
    if not kind.name:
        raise ValueError(f"{type(kind).__name__} has no name")
    old = KINDS.get(kind.name)
    if old is not None and old is not kind:
        raise ValueError(f"op kind {kind.name!r} is already registered")
    KINDS[kind.name] = kind
    return kind


def kind(name: str) -> OpKind:
    """The op kind called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown op kind {name!r}; registered: {', '.join(KINDS) or 'none'} "
                         "(mlx_bricks.bricks.kinds() registers every brick's)") from None
