"""``advertised``: the block size Dynamo is told is the one SGLang's events carry
(:mod:`kvalign.verify.advertised`). Exhaustive over the page-size overrides the installed SGLang
has, so its rows (one per override) are known only when it runs: one job."""

from __future__ import annotations

from typing import Any

from kvalign.verify.property import Job, Options
from kvalign.verify.rows import RowResult


class Advertised:
    name = "advertised"
    modes = ("plain",)
    default = True
    events = "none"
    budget = None

    def jobs(self, opts: Options) -> list[Job]:
        return [Job(self.name, ("plain",), (), cost=15.0)] if "plain" in opts.modes else []

    def run(self, job: Job, systems: Any, opts: Options) -> list[RowResult]:
        from kvalign.verify.advertised import run_advertised_rows

        return run_advertised_rows(job.modes, opts.page_size)


PROPERTY = Advertised()
