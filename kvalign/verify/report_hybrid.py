"""``kvalign report`` for the hybrid and storage findings: the search that gives each its counterexample.

The ``hybrid`` and ``storage`` rows are not :class:`~kvalign.verify.property.SearchProperty` searches
over ``check``'s caches, so :func:`kvalign.verify.report.search` cannot find them; this runs their
own bodies (:class:`~kvalign.verify.hybrid.HybridRun`, :class:`~kvalign.verify.storage.StorageRun`)
against a fresh router path, as ``check --property hybrid|storage`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvalign.model.causes import Cause

HYBRID = {Cause.SWA_STATE_NOT_REUSABLE: "swa", Cause.MAMBA_STATE_NOT_REUSABLE: "mamba"}
CAUSES = frozenset({*HYBRID, Cause.STORAGE_TIER_UNCREDITED})


def search(cause: Cause, modes: Sequence[str], examples: int) -> tuple[Any, str, str, str]:
    """The first counterexample for ``cause``: (mismatch, property, mode, variant)."""
    from kvalign.oracles.router_path import RouterPath
    from kvalign.verify.search import run_search

    path = RouterPath()
    try:
        for mode in modes:
            eagle = mode == "eagle"
            if cause in HYBRID:
                from kvalign.verify.hybrid import HybridRun, hybrid_scenarios

                component = HYBRID[cause]
                _c, _f, found = run_search(HybridRun(path, component, eagle), hybrid_scenarios(component, eagle), examples)
                if found is not None and found.cause is cause:
                    return found, "hybrid", mode, component
                continue
            from kvalign.verify.storage import StorageRun, storage_scenarios
            from kvalign.verify.tier import TierPath

            tiers = TierPath(path)
            try:
                body = StorageRun(tiers, eagle, "base")
                _c, _f, found = run_search(body, storage_scenarios(eagle), examples)
            finally:
                tiers.close()
            found = found if found is not None else body.finding  # the under-credit is counted, not raised
            if found is not None and found.cause is cause:
                return found, "storage", mode, "base"
    finally:
        path.close()
    raise LookupError(f"no counterexample for {cause.name} in {examples} examples per mode")
