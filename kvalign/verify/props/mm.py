"""``mm`` (opt-in): image prompts through Dynamo's real frontend and SGLang's real multimodal path
(:mod:`kvalign.verify.mm`). One job for both modes: the frontend and the processor start once
(20-40 s on two cores)."""

from __future__ import annotations

from typing import Any

from kvalign.verify.property import Budget, Job, Options
from kvalign.verify.rows import MODES, RowResult

MM_BUDGET = Budget("mm", 25, "cap on generated image scenarios per mm row (default 25; each runs two chat requests "
                             "through Dynamo's frontend and SGLang's multimodal path)")


class Mm:
    name = "mm"
    modes = MODES
    default = False
    events = "each"
    budget = MM_BUDGET

    def jobs(self, opts: Options) -> list[Job]:
        modes = tuple(m for m in self.modes if m in opts.modes)
        return [Job(self.name, modes, cost=60.0)] if modes else []

    def run(self, job: Job, systems: Any, opts: Options) -> list[RowResult]:
        from kvalign.verify.mm import run_mm_rows

        return run_mm_rows(systems, job.modes, opts.examples_for(self.budget), opts.seed, page_size=opts.page_size)


PROPERTY = Mm()
