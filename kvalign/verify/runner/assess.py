"""Every finding row's class, and its routing impact measured on the real router: the step ``check``
runs after its rows, dispatching each finding to the property that knows how to measure it.

It sits in the runner, above the properties, because it needs the storage and hybrid properties'
own measurements (:mod:`kvalign.verify.props.storage.impact`, :mod:`kvalign.verify.props.hybrid.impact`)
beside the engine's host-credit skew (:func:`kvalign.verify.engine.impact.assess_skew`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvalign.model.causes import CREDIT_SKEW, Cause
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.impact import RoutingImpact, assess_skew, row_class
from kvalign.verify.engine.rows import RowResult


def assess(rows: Sequence[RowResult], router_path: Callable[[], Any] | None = None) -> None:
    """Fill each finding row's class; for a credit skew its bound and measured routing impact; for the storage
    and hybrid findings (cache-blind, no constant bound) the measured routing impact.

    ``router_path()``: the run's own router path (``check`` measures on the path of the process that ran
    the rows, which closes it); None opens one for the call."""
    from kvalign.verify.props.hybrid.impact import HYBRID_CAUSES, assess_hybrid
    from kvalign.verify.props.storage.impact import assess_storage

    skews = [r for r in rows if row_class(r) == CREDIT_SKEW]
    storage = [r for r in rows if r.cause_name == Cause.STORAGE_TIER_UNCREDITED.name]
    hybrid = [r for r in rows if r.cause_name in HYBRID_CAUSES]
    for r in rows:
        r.finding_class = row_class(r)
    if not skews and not storage and not hybrid:
        return
    if router_path is None:
        from kvalign.oracles.router_path import RouterPath

        path = RouterPath()
    else:
        path = router_path()
    try:
        measured: dict[tuple[Any, ...], RoutingImpact] = {}
        measures = [(r, lambda r=r: assess_skew(r, path, measured)) for r in skews]
        measures += [(r, lambda r=r: assess_storage(r, path)) for r in storage]
        measures += [(r, lambda r=r: assess_hybrid(r, path)) for r in hybrid]
        for r, measure in measures:
            try:
                measure()
            except OracleUnavailable as exc:  # a release whose router cannot be set up for the measurement (1.3.1)
                r.impact = f"routing impact not measured: {exc}"
    finally:
        if router_path is None:
            path.close()
