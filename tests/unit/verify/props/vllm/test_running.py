"""How a row of ``check --engine vllm`` runs (kvalign/verify/props/vllm/running.py): a path that cannot answer is the
row's ``n/a`` with the reason, never an exception that ends the whole check.

Dynamo 1.0.2's ``KvRouter`` has no ``get_overlap_scores``, which the ``tiers`` and ``mm`` rows ask it for: the matrix's
1.0.2 x vLLM 0.33.0 pair was an ``error`` row on that exception. That release's binding cannot load beside the
1.6.1 one this process runs (its pair runs in its own environment: docs/vllm.md), so here Dynamo 1.6.1's real relay
and ``KvRouter`` stand in for it with that one method hidden, everything else real, vLLM's engines included.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import strategies as st
from router_paths import open_router_path

from kvalign.model.causes import Cause
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.props.vllm import tiers
from kvalign.verify.props.vllm.running import _row, _searched
from kvalign.verify.runner.confirm import environment_rows

B = 16
NO_SCORES = "Dynamo 1.0.2's KvRouter has no get_overlap_scores"


def _lacking(_value: Any) -> None:
    raise OracleUnavailable(NO_SCORES)


def test_a_row_whose_path_cannot_answer_is_n_a_with_the_reason():
    row = _row("mm", "base", _lacking, st.just([1]), 3, 0, None)
    assert (row.cause_name, row.detail, row.cases) == (Cause.PATH_UNAVAILABLE.name, NO_SCORES, 0)
    environment_rows([row])  # as check publishes it
    assert row.status == "n/a" and NO_SCORES in row.skipped


def test_negative_control_without_the_helper_the_exception_escapes_the_row():
    with pytest.raises(OracleUnavailable, match="no get_overlap_scores"):
        _searched("mm", "base", _lacking, st.just([1]), 3, 0, None)


class _WithoutOverlapScores:
    """A real ``KvRouter`` with ``get_overlap_scores`` hidden, as Dynamo 1.0.2's has none."""

    def __init__(self, router: Any) -> None:
        self._router = router

    def __getattr__(self, name: str) -> Any:
        if name == "get_overlap_scores":
            raise AttributeError(name)
        return getattr(self._router, name)


class _PathWithoutOverlapScores:
    """The real relay -> router path, each router it attaches for a vLLM worker without ``get_overlap_scores``."""

    def __init__(self, path: Any) -> None:
        self._path = path

    def __getattr__(self, name: str) -> Any:
        return getattr(self._path, name)

    def attach(self, *args: Any, **kw: Any) -> Any:
        ingest = self._path.attach(*args, **kw)
        ingest.router = _WithoutOverlapScores(ingest.router)
        return ingest


@pytest.fixture(scope="module")
def path() -> Iterator[Any]:
    p = open_router_path("the relay -> KvRouter path for vLLM's events")
    yield p
    p.close()


def test_a_router_without_get_overlap_scores_makes_the_tiers_row_n_a_naming_it(path):
    """The tiers row opens a vLLM worker of its own (vLLM's real CPU tier) and queries per-tier overlap: n/a."""
    row = tiers.row(_PathWithoutOverlapScores(path), B, 2, 0)
    assert (row.prop, row.variant, row.cause_name) == ("tiers", "base", Cause.PATH_UNAVAILABLE.name), row
    assert "has no get_overlap_scores" in row.detail and row.control is None


def test_negative_control_the_same_row_on_the_whole_router_runs(path):
    row = tiers.row(path, B, 2, 0)
    assert (row.cases, row.cause_name) == (2, None) and row.control["failed"], row
