"""What a benchmark is: :class:`Benchmark` and the backend tags of the benchmarks that run on
whichever backend the patch selects. The table (``bench.core``) and the modules that define
benchmarks (``bench.moe``, ``bench.formats``, ``bench.gated_delta``, ``bench.user_path``) all
import it, so none of them imports the table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

#: ``Benchmark.backend`` of a benchmark that needs a kernel backend (``metal`` or ``cuda``) and
#: runs on whichever the patch selects: without one the patch leaves the model stock, and a
#: comparison of stock with itself would mean nothing.
KERNEL = "metal|cuda"
#: ``Benchmark.backend`` of a benchmark of the CPU path: it runs where no kernel backend exists
#: (auto selection gives ``reference``; the patch tunes the composites there).
CPU = "cpu"


@dataclass(frozen=True)
class Benchmark:
    """One benchmark.

    Attributes:
        name: unique name (``--only`` selects by it).
        backend: the bricks backend it needs (``mlx_bricks.backends.BACKENDS``), or
            :data:`KERNEL` for one that runs on whichever kernel backend the patch selects.
        what: one line: the op, shape and dtype.
        setup: ``() -> (brick, stock)`` or ``(brick, stock, info)``: two zero-argument
            callables that each run the computation once on the same inputs and return the lazy
            ``mx.array`` result (evaluated by the timer), and optionally ``info() -> dict``,
            JSON-ready facts merged into the result after timing (e.g. the patch's decisions).
            None for a benchmark that measures itself (``run``).
        min_calls: fewest calls per ``mx.eval`` when timing.
        run: ``(repeats) -> dict``: a benchmark that does its own measuring (the user's path:
            mlx-lm's CLIs in fresh processes) and returns its JSON-ready result entry; the
            runner calls it instead of timing ``setup``'s callables.
    """

    name: str
    backend: str
    what: str
    setup: Callable[[], tuple] | None
    min_calls: int = 1
    run: Callable[[int], dict] | None = None
