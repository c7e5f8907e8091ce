"""``storage`` (opt-in): HiCache's storage tier (the ``file`` backend) against the router's tiers, and
tenants kept apart on every tier, storage included (:mod:`kvalign.verify.storage`)."""

from __future__ import annotations

from typing import Any

from kvalign.verify.property import Budget, Job, Options
from kvalign.verify.rows import MODES, VARIANTS, RowResult

STORAGE_BUDGET = Budget("storage", 8, "cap on generated scenarios per storage row (default 8; each writes pages to "
                                      "storage, evicts them and refills them through SGLang's real controller)")


class Storage:
    """Opt-in: it writes files (a temporary directory per example) and its tier rows hold a finding on
    the pinned pair (pages in storage are credited in no tier)."""

    name = "storage"
    modes = MODES
    default = False
    events = "own"
    budget = STORAGE_BUDGET

    def jobs(self, opts: Options) -> list[Job]:
        variants = tuple(v for v in VARIANTS if v in opts.variants)  # base: the tiers; the others: two tenants
        scale = opts.examples_for(self.budget) / STORAGE_BUDGET.default
        return [Job(self.name, (m,), variants, cost=20.0 * scale) for m in self.modes if m in opts.modes]

    def run(self, job: Job, systems: Any, opts: Options) -> list[RowResult]:
        from kvalign.verify.storage import run_storage_rows

        return run_storage_rows(systems, job.modes, job.variants, opts.examples_for(self.budget), seed=opts.seed,
                                page_size=opts.page_size)


PROPERTY = Storage()
