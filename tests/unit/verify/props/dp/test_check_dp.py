"""The ``dp`` property on the real code of both sides, and its negative controls.

SGLang's own placement and per-scheduler publishers (``select_kv_publisher_dp_rank``), the installed
``dynamo.sglang``'s card and relays (``get_runtime_config``, ``init_kv_event_publish``), and a real
``KvRouter`` whose requests reach a served endpoint. Each negative control is a fault from the
issue history applied to those real objects, and must fail naming its own cause and the rank.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvalign.model.causes import Cause
from router_paths import open_router_path

EXAMPLES = 8


@pytest.fixture(scope="module")
def router_path(sglang_available: str) -> Iterator[Any]:
    path = open_router_path("Dynamo's in-process runtime is unavailable")
    yield path
    path.close()


def _rows(router_path: Any, layouts: tuple[str, ...], examples: int = EXAMPLES, **kw: Any) -> list[Any]:
    from kvalign.verify.runner.check import run_search
    from kvalign.verify.props.dp.body import run_dp_rows

    return run_dp_rows(lambda: router_path, ("plain",), examples, run_search, layouts=layouts, **kw)


@pytest.mark.parametrize("layout", ["pure-dp2", pytest.param("dp-attn2", marks=pytest.mark.slow)])
def test_two_rank_rows_are_aligned_and_say_what_each_side_decided(router_path: Any, layout: str) -> None:
    (row,) = _rows(router_path, (layout,))
    assert row.ok and row.skipped is None, row.detail
    assert row.cases == EXAMPLES
    # SGLang's scheduler of rank r publishes rank r on base + r; Dynamo registers and subscribes both
    assert "rank 0 on tcp://127.0.0.1:" in row.detail and "rank 1 on tcp://127.0.0.1:" in row.detail
    assert "tagged {0: [0], 1: [1]}" in row.detail
    assert "card registers ranks [0, 2)" in row.detail
    assert ("DP attention" if layout.startswith("dp-attn") else "pure DP") in row.detail


@pytest.mark.slow
def test_four_rank_rows_are_aligned(router_path: Any) -> None:
    rows = _rows(router_path, ("pure-dp4", "dp-attn4"), examples=20)
    assert [(r.variant, r.ok) for r in rows] == [("pure-dp4", True), ("dp-attn4", True)], [r.detail for r in rows]
    assert all("card registers ranks [0, 4)" in r.detail for r in rows)


@pytest.mark.parametrize("fault, cause", [
    ("rank0-only", Cause.DP_RANK_UNPUBLISHED),  # sglang #16030: only DP rank 0's scheduler publishes
    ("tag-rank0", Cause.DP_RANK_TAG),  # every batch stamped attn_dp_rank 0 on its own rank's port
    ("unsubscribed", Cause.DP_RANK_UNSUBSCRIBED),  # dynamo #5108: the card registers both, the relay reads rank 0
    ("pin-rank0", Cause.DP_ROUTED_ELSEWHERE),  # a gateway forcing rank 0 through KvRouter.generate
])
def test_negative_control_fails_naming_its_cause_and_the_rank(router_path: Any, fault: str, cause: Cause) -> None:
    (row,) = _rows(router_path, ("pure-dp2",), examples=10, fault=fault, barrier_timeout_s=1.5)
    assert not row.ok, f"{fault} went unnoticed: {row.detail}"
    assert row.cause_name == cause.name, row.detail
    assert "rank 1" in row.detail
    assert row.counterexample["stores"], row.counterexample


@pytest.mark.slow
def test_dp_attention_negative_control_names_the_attention_rank(router_path: Any) -> None:
    (row,) = _rows(router_path, ("dp-attn2",), examples=10, fault="rank0-only", barrier_timeout_s=1.5)
    assert row.cause_name == Cause.DP_RANK_UNPUBLISHED.name
    assert "rank 1's scheduler (tp_rank 1, dp_rank 1)" in row.detail


def test_a_relay_slower_than_the_barrier_is_waited_on_not_named_dropped(router_path: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's answers credit nothing for the row's first 1.5 s (a relay that delivers late, as on a machine
    loaded as three ``check`` workers at load 12 were: a 4 s barrier ran out there), against a 0.2 s barrier:
    every rank misses it, and the row is still aligned, each rank revived by its longer wait."""
    from kvalign.oracles.dp_dynamo import DpWorker

    scores, first = DpWorker.scores, []

    def late(self: DpWorker, tokens: list[int]) -> dict[int, int]:
        first.append(first[0] if first else time.monotonic())
        return scores(self, tokens) if time.monotonic() - first[0] > 1.5 else {}

    monkeypatch.setattr(DpWorker, "scores", late)
    (row,) = _rows(router_path, ("pure-dp2",), barrier_timeout_s=0.2, revive_timeout_s=10.0)
    assert row.ok and row.skipped is None, row.detail
    assert row.cases == EXAMPLES


def test_negative_control_a_rank_the_router_never_credits_is_events_dropped_after_one_longer_wait(
        router_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The control of the wait above: the router's answers never credit rank 0 (as a relay that drops its
    stream); nothing on either side explains it, so the row names EVENTS_DROPPED, and the search, shrinking
    included, waits the longer bound once."""
    from kvalign.oracles.dp_dynamo import DpWorker
    from kvalign.verify.props.dp.body import DpRig

    scores, await_credit, waits = DpWorker.scores, DpRig._await_credit, []
    monkeypatch.setattr(DpWorker, "scores", lambda self, tokens: {r: n for r, n in scores(self, tokens).items() if r})

    def counted(rig: DpRig, pending: dict, timeout_s: float) -> dict:
        waits.append(timeout_s)
        return await_credit(rig, pending, timeout_s)

    monkeypatch.setattr(DpRig, "_await_credit", counted)
    (row,) = _rows(router_path, ("pure-dp2",), examples=10, barrier_timeout_s=0.2, revive_timeout_s=0.7)
    assert row.cause_name == Cause.EVENTS_DROPPED.name and "rank 0's events" in row.detail, row.detail
    assert waits.count(0.7) == 1, waits


def test_dp_rows_run_in_plain_mode_only(router_path: Any) -> None:
    from kvalign.verify.runner.check import run_search
    from kvalign.verify.props.dp.body import run_dp_rows

    assert run_dp_rows(lambda: router_path, ("eagle",), 1, run_search) == []
