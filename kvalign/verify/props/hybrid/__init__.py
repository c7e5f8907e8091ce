"""``hybrid`` (opt-in): the router's credit against what SGLang's real UnifiedRadixCache with a
sliding-window or Mamba component can reuse, each row with its negative control (:mod:`kvalign.verify.props.hybrid.body`).
One job for both modes: they share the router path. Opt-in: a dense deployment has nothing to check here,
and its rows hold findings on the pinned pair."""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import Budget, Options, SetUpOnceProperty
from kvalign.verify.engine.rows import RowResult

HYBRID_BUDGET = Budget("hybrid", 20, "cap on generated scenarios per hybrid row (default 20; each runs up to 8 steps "
                                     "through the real relay and router)")


def _rows(systems: Any, modes: tuple[str, ...], opts: Options) -> list[RowResult]:
    from kvalign.verify.props.hybrid.body import run_hybrid_rows

    return run_hybrid_rows(systems, modes, opts.examples_for(HYBRID_BUDGET), seed=opts.seed, page_size=opts.page_size)


PROPERTY = SetUpOnceProperty("hybrid", rows=_rows, default=False, surface="hybrid models", events="own", budget=HYBRID_BUDGET,
                             variants=("swa", "mamba"), cost=16.0)
