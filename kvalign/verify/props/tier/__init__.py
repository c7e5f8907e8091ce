"""``tier``: the router's device / host tiers against SGLang's HiCache, one state-machine search
per mode x variant (:mod:`kvalign.verify.props.tier.body`)."""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import Budget, Job, Options
from kvalign.verify.engine.rows import MODES, RowResult

#: State-machine runs per tier row (each up to STEPS steps through the real path); servable shares it.
TIER_BUDGET = Budget("tier", 12, "cap on generated state-machine runs per tier / servable row (default 12)")


class Tier:
    """``servable`` is this machine with SGLang's load-back judged on every admitted request."""

    name = "tier"
    modes = MODES
    default = True
    surface = "a host tier"
    engine = "sglang"
    events = "each"
    budget = TIER_BUDGET
    #: the variants it has rows for (None: every variant asked)
    variants: tuple[str, ...] | None = None
    cost = 1.0

    def jobs(self, opts: Options) -> list[Job]:
        variants = tuple(v for v in opts.variants if self.variants is None or v in self.variants)
        scale = opts.examples_for(self.budget) / TIER_BUDGET.default
        return [Job(self.name, (m,), (v,), cost=self.cost * scale) for m in self.modes if m in opts.modes for v in variants]

    def run(self, job: Job, systems: Any, opts: Options) -> list[RowResult]:
        from kvalign.verify.props.tier.body import run_tier_rows

        return run_tier_rows(systems, self.name, job.modes, job.variants, opts.examples_for(self.budget), opts.seed,
                             page_size=opts.page_size, event_format=job.event_format)


PROPERTY = Tier()
