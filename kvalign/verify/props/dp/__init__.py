"""``dp``: data-parallel ranks on the real code of both sides, one row per layout, plain mode only
(:mod:`kvalign.verify.props.dp.body`)."""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import Budget, Job, Options
from kvalign.verify.engine.rows import RowResult

DP_BUDGET = Budget("dp", 20, "cap on generated cases per dp row (each caches on every rank and routes; default 20)")


class Dp:
    name = "dp"
    modes = ("plain",)
    default = True
    surface = "DP attention"
    engine = "sglang"
    events = "own"  # its schedulers build caches of their own, in the default format
    budget = DP_BUDGET

    def jobs(self, opts: Options) -> list[Job]:
        from kvalign.oracles.dp_sglang import DP_LAYOUTS

        if "plain" not in opts.modes:
            return []
        scale = opts.examples_for(self.budget) / DP_BUDGET.default
        # shares: its registered worker imports dynamo.sglang, as card and advertised do (1.2 CPU-s in a check
        # worker that had not imported it)
        return [Job(self.name, ("plain",), (layout,), cost=1.2 * scale, shares="registration") for layout in DP_LAYOUTS]

    def run(self, job: Job, systems: Any, opts: Options) -> list[RowResult]:
        from kvalign.verify.props.dp.body import run_dp_rows
        from kvalign.verify.engine.search import run_search

        return run_dp_rows(systems.router_path, job.modes, opts.examples_for(self.budget), run_search, seed=opts.seed,
                           page_size=opts.page_size, layouts=job.variants)


PROPERTY = Dp()
