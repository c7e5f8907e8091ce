"""``kvalign report`` for the storage finding: the search that gives it its counterexample.

The ``storage`` rows are not :class:`~kvalign.verify.engine.property.SearchProperty` searches over
``check``'s caches, so :func:`kvalign.verify.engine.search` cannot find them; this runs the
property's own body (:class:`~kvalign.verify.props.storage.body.StorageRun`) against a fresh router
path, as ``check --property storage`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvalign.model.causes import Cause

CAUSES = frozenset({Cause.STORAGE_TIER_UNCREDITED})


def search(cause: Cause, modes: Sequence[str], examples: int) -> tuple[Any, str, str, str]:
    """The first counterexample for ``cause``: (mismatch, property, mode, variant)."""
    from kvalign.oracles.router_path import RouterPath
    from kvalign.verify.engine.search import run_search
    from kvalign.verify.props.storage.body import StorageRun, storage_scenarios
    from kvalign.verify.props.tier.body import TierPath

    path = RouterPath()
    try:
        for mode in modes:
            tiers = TierPath(path)
            try:
                body = StorageRun(tiers, mode == "eagle", "base")
                _c, _f, found = run_search(body, storage_scenarios(mode == "eagle"), examples)
            finally:
                tiers.close()
            found = found if found is not None else body.finding  # the under-credit is counted, not raised
            if found is not None and found.cause is cause:
                return found, "storage", mode, "base"
    finally:
        path.close()
    raise LookupError(f"no counterexample for {cause.name} in {examples} examples per mode")
