"""``hybrid`` (opt-in): the router's credit against what SGLang's real UnifiedRadixCache with a
sliding-window or Mamba component can reuse, each row with its negative control (:mod:`kvalign.verify.hybrid`)."""

from __future__ import annotations

from typing import Any

from kvalign.verify.property import Budget, Job, Options
from kvalign.verify.rows import MODES, RowResult

HYBRID_BUDGET = Budget("hybrid", 20, "cap on generated scenarios per hybrid row (default 20; each runs up to 8 steps "
                                     "through the real relay and router)")


class Hybrid:
    """Opt-in: its rows hold findings on the pinned pair (a hybrid model's credit skew), and a dense
    deployment has nothing to check here."""

    name = "hybrid"
    modes = MODES
    default = False
    events = "own"
    budget = HYBRID_BUDGET

    def jobs(self, opts: Options) -> list[Job]:
        scale = opts.examples_for(self.budget) / HYBRID_BUDGET.default
        return [Job(self.name, (m,), ("swa", "mamba"), cost=30.0 * scale) for m in self.modes if m in opts.modes]

    def run(self, job: Job, systems: Any, opts: Options) -> list[RowResult]:
        from kvalign.verify.hybrid import run_hybrid_rows

        return run_hybrid_rows(systems, job.modes, opts.examples_for(self.budget), seed=opts.seed,
                               page_size=opts.page_size)


PROPERTY = Hybrid()
