"""``kvalign report`` for the hybrid findings: the search that gives each its counterexample.

The ``hybrid`` rows are not :class:`~kvalign.verify.engine.property.SearchProperty` searches over
``check``'s caches, so :func:`kvalign.verify.engine.search` cannot find them; this runs the
property's own body (:class:`~kvalign.verify.props.hybrid.body.HybridRun`) against a fresh router
path, as ``check --property hybrid`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvalign.model.causes import Cause

HYBRID = {Cause.SWA_STATE_NOT_REUSABLE: "swa", Cause.MAMBA_STATE_NOT_REUSABLE: "mamba"}
CAUSES = frozenset(HYBRID)


def search(cause: Cause, modes: Sequence[str], examples: int) -> tuple[Any, str, str, str]:
    """The first counterexample for ``cause``: (mismatch, property, mode, variant)."""
    from kvalign.oracles.router_path import RouterPath
    from kvalign.verify.engine.search import run_search
    from kvalign.verify.props.hybrid.body import HybridRun, hybrid_scenarios

    path = RouterPath()
    try:
        for mode in modes:
            component = HYBRID[cause]
            _c, _f, found = run_search(HybridRun(path, component, mode == "eagle"), hybrid_scenarios(component, mode == "eagle"),
                                       examples)
            if found is not None and found.cause is cause:
                return found, "hybrid", mode, component
    finally:
        path.close()
    raise LookupError(f"no counterexample for {cause.name} in {examples} examples per mode")
