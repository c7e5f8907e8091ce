"""The live fuzz's six invariants (kvalign/live/runs/fuzz/invariants.py): each holds on agreeing
numbers and fails, naming itself, when one view disagrees."""

from __future__ import annotations

import pytest

from kvalign.live.wire.client import Completion
from kvalign.live.runs.fuzz.invariants import INVARIANTS, Observation, Tally, evaluate

B = 16


def obs(n: int = 40, rate: float | None = 2 / 3, cached: int | None = 32, *, predicted: tuple = (2,),
        held: tuple = (2,), worker: int = 7, label: str | None = "worker0", best: str | None = None,
        retired: frozenset = frozenset(), restarted: bool = False) -> Observation:
    c = Completion(n, cached, [4, 0], worker, worker, rate)
    return Observation(1, list(range(n)), c, label, False, B, True, list(predicted), list(held), best, retired, restarted)


def failed(o: Observation) -> set[str]:
    tally = Tally()
    names = {name for name, _ in evaluate(o, tally)}
    assert all(tally.failed[n] == (n in names) for n in INVARIANTS)
    return names


def test_agreeing_views_pass_every_checked_invariant() -> None:
    tally = Tally()
    assert evaluate(obs(best="worker0", retired=frozenset({1}), restarted=False), tally) == []
    assert {n for n, v in tally.checked.items() if v} == {
        "router_matches_prediction", "engine_matches_index", "no_stale_credit", "best_worker_chosen", "restart_forgotten"}


@pytest.mark.parametrize("case, broken", [
    (dict(rate=0.0), {"router_matches_prediction"}),  # router blind: ROUTER_EAGLE_OFF looks like this
    (dict(cached=16), {"engine_matches_index"}),
    (dict(rate=1.0, predicted=(3,), held=(2,), cached=32), {"no_stale_credit"}),
    (dict(best="worker1"), {"best_worker_chosen"}),
    (dict(retired=frozenset({7})), {"restart_forgotten"}),
    (dict(rate=1 / 3, predicted=(1,), held=(1,), cached=16, restarted=True, retired=frozenset({5})), set()),
    (dict(rate=2 / 3, predicted=(0,), held=(2,), restarted=True, retired=frozenset({5})),
     {"router_matches_prediction", "restart_forgotten"}),
])
def test_each_disagreement_fails_its_invariant(case: dict, broken: set[str]) -> None:
    assert failed(obs(**case)) == broken


def test_a_concurrent_window_accepts_any_mark_and_nothing_outside_it() -> None:
    assert failed(obs(rate=1 / 3, cached=16, predicted=(0, 1, 2), held=(0, 1, 2))) == set()
    assert failed(obs(rate=1.0, predicted=(0, 1, 2), held=(0, 1, 2))) >= {"router_matches_prediction", "no_stale_credit"}


def test_an_unknown_worker_fails_routing() -> None:
    assert failed(obs(label=None)) == {"router_matches_prediction"}


def test_engine_check_is_skipped_only_without_an_engine_report() -> None:
    tally = Tally()
    evaluate(obs(cached=None), tally)
    assert tally.checked["engine_matches_index"] == 0 and tally.checked["router_matches_prediction"] == 1
