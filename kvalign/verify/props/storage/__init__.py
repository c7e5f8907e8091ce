"""``storage`` (opt-in): HiCache's storage tier (the ``file`` backend) against the router's tiers, and
tenants kept apart on every tier, storage included (:mod:`kvalign.verify.props.storage.body`). One job for both
modes: they share the router path. Opt-in: it writes files (a temporary directory per example) and its
tier rows hold a finding on the pinned pair."""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import Budget, Options, SetUpOnceProperty
from kvalign.verify.engine.rows import VARIANTS, RowResult

STORAGE_BUDGET = Budget("storage", 8, "cap on generated scenarios per storage row (default 8; each writes pages to "
                                      "storage, evicts them and refills them through SGLang's real controller)")


def _rows(systems: Any, modes: tuple[str, ...], opts: Options) -> list[RowResult]:
    from kvalign.verify.props.storage.body import run_storage_rows

    return run_storage_rows(systems, modes, opts.variants, opts.examples_for(STORAGE_BUDGET), seed=opts.seed,
                            page_size=opts.page_size)


PROPERTY = SetUpOnceProperty("storage", rows=_rows, default=False, surface="a storage tier", events="own", budget=STORAGE_BUDGET,
                             variants=tuple(VARIANTS), cost=5.0)
