"""The hybrid findings' routing impact on a real ``KvRouter`` with two candidates (issue 43).

Rank 0 is SGLang's real hybrid cache after the finding's steps, rank 1 a cache of the same kind holding
the query's first k pages intact. On SGLang's production path (an SWA request decoded past its window; a
Mamba request cached whole and queried at a prefix) the router credits pages SGLang cannot reuse and picks
that candidate over one that reuses more: ``changes_worker``. The shrunk one-block counterexample cannot
flip a choice (k = 1 is a tie, reported as one). The negative control is the same request with its state
intact: no choice changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def path(sglang_available: str) -> Iterator[Any]:
    from router_paths import open_router_path

    opened = open_router_path("Dynamo's relay / router cannot start here")
    yield opened
    opened.close()


@pytest.mark.parametrize("component,page_size", [("swa", 2), ("mamba", 1)])
def test_the_production_path_changes_the_routers_choice(path: Any, component: str, page_size: int) -> None:
    from kvalign.verify.props.hybrid.impact import WORST_PAGES, measure_hybrid_routing, worst

    example, what = worst(component, page_size, False)
    impact = measure_hybrid_routing(example, path, what)
    assert (impact.credited, impact.reusable) == (WORST_PAGES - 2, 0), impact.says()
    assert [t.k for t in impact.trials if t.changed] == list(range(1, WORST_PAGES - 2)), impact.says()
    assert impact.trials[-1].tie and not impact.trials[-1].changed, impact.says()


def test_a_one_block_skew_changes_no_choice_and_its_tie_is_said(path: Any) -> None:
    """The SWA row's shrunk counterexample: one block credited, none reusable. k=0: the first (0 vs 0
    reused); k=1: both credited one block, a tie, never a flip."""
    from kvalign.verify.props.hybrid.impact import measure_hybrid_routing

    example = {"component": "swa", "page_size": 2, "eagle": False, "window": 2, "core": "RustUnifiedTreeCore",
               "steps": [["insert", [0, 0, 0, 0]], ["evict_state", 1]], "query": [0, 0, 4]}
    impact = measure_hybrid_routing(example, path, "the counterexample")
    assert not impact.changes_worker and impact.trials[1].tie, impact.says()
    assert "a tie decided 1 of 2 k" in impact.says(), impact.says()


def test_negative_control_state_intact_changes_no_choice(path: Any) -> None:
    from kvalign.verify.props.hybrid.impact import measure_hybrid_routing, worst

    example, _ = worst("swa", 2, False)
    example["steps"] = [["insert", example["steps"][0][1]]]  # cached with its window intact
    impact = measure_hybrid_routing(example, path, "the request cached whole")
    assert impact.reusable == impact.credited and not impact.changes_worker, impact.says()


def test_a_row_gets_a_measured_changes_worker(path: Any) -> None:
    from kvalign.model.causes import Cause
    from kvalign.verify.props.hybrid.impact import assess_hybrid
    from kvalign.verify.engine.rows import RowResult

    c = Cause.MAMBA_STATE_NOT_REUSABLE
    row = RowResult("hybrid", "plain", "mamba", 3, 1, 0.0, c.value, c.name,
                    counterexample={"component": "mamba", "page_size": 1, "eagle": False, "window": None,
                                    "core": "RustUnifiedTreeCore", "steps": [["insert", [0]], ["insert", [0, 0, 0]]],
                                    "query": [0, 0, 4]})
    assess_hybrid(row, path)
    assert row.changes_worker is True and set(row.routing) == {"counterexample", "production_worst"}, row.impact
    assert "on SGLang's production path the router changes the worker" in row.impact, row.impact
