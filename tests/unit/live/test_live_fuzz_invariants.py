"""The live fuzz's invariants (kvalign/live/runs/fuzz/invariants.py): each holds on agreeing numbers
and fails *alone*, naming itself first, on the disagreement its live control produces."""

from __future__ import annotations

import pytest

from kvalign.live.runs.fuzz.invariants import INVARIANTS, Observation, Tally, evaluate
from kvalign.live.wire.client import Completion

B = 16


def obs(n: int = 40, rate: float | None = 2 / 3, engine: int | None = 32, *, predicted: int = 2, held: int = 2,
        label: str | None = "worker0", best: str | None = None, faulted: bool = False,
        prompt_tokens: int | None = None) -> Observation:
    c = Completion(n if prompt_tokens is None else prompt_tokens, engine, [4, 0, 4], 7, 7, rate)
    return Observation(1, list(range(n)), c, label, False, B, True, predicted, held, engine, hop_faulted=faulted,
                       best=best)


def first_failure(o: Observation, tally: Tally | None = None) -> tuple[str | None, set[str]]:
    tally = tally or Tally()
    failures = evaluate(o, tally)
    names = {name for name, _ in failures}
    assert all(tally.failed[n] == (n in names) for n in INVARIANTS)
    return (failures[0][0] if failures else None), names


def test_agreeing_views_pass_every_checked_invariant() -> None:
    tally = Tally()
    assert evaluate(obs(best="worker0"), tally) == []
    assert {n for n, v in tally.checked.items() if v} == {
        "router_credits_engine_reuse", "router_matches_prediction", "engine_matches_index", "no_stale_credit",
        "best_worker_chosen"}  # decode_keeps_speculating is judged per window (test_live_fuzz_speculation.py)


@pytest.mark.parametrize("control, case, first", [
    # router eagle off (or a salt the hop stripped): the router credits 0, the engine reused 32
    ("router eagle off", dict(rate=0.0, predicted=2), "router_credits_engine_reuse"),
    # the hop lost a store batch and kvalign ignores it (--no-gap-check): rcer is not asked
    ("gap check off", dict(rate=0.0, predicted=2, faulted=True), "router_matches_prediction"),
    # the hop lost a removal: router and its view still hold 2 blocks the engine evicted
    ("lost removal", dict(rate=2 / 3, predicted=2, held=0, engine=0, faulted=True), "no_stale_credit"),
    # the engine saw other tokens, or reused pages kvalign never saw it store
    ("engine view wrong", dict(held=1), "engine_matches_index"),
    ("prompt changed", dict(prompt_tokens=41), "engine_matches_index"),
    ("routing ignores overlap", dict(best="worker1"), "best_worker_chosen"),
])
def test_each_control_fails_its_own_invariant_first(control: str, case: dict, first: str) -> None:
    assert first_failure(obs(**case))[0] == first, control


@pytest.mark.parametrize("control, case, failing", [
    # router eagle off, or the hop strips cache_salt: the router credits 0 of what its view holds
    ("router eagle off / salt stripped", dict(rate=0.0, predicted=2),
     {"router_credits_engine_reuse", "router_matches_prediction"}),
    ("gap check off", dict(rate=0.0, predicted=2, faulted=True), {"router_matches_prediction"}),
    ("lost removal", dict(rate=2 / 3, predicted=2, held=0, engine=0, faulted=True), {"no_stale_credit"}),
    # a batch lost unpublished, or a store the engine's own publisher dropped, mis-linked or mis-hashed:
    # the engine reused pages neither view holds, and the router rightly credited none of them
    ("unpublished batch / publisher fault", dict(rate=0.0, predicted=0, held=0),
     {"engine_matches_index", "router_credits_engine_reuse"}),
    ("routing against the cache view", dict(best="worker1"), {"best_worker_chosen"}),
])
def test_which_invariants_a_control_breaks(control: str, case: dict, failing: set[str]) -> None:
    """The full set each live control fails (docs/live-fuzz.md; tests/e2e/test_fuzz.py asserts it live)."""
    assert first_failure(obs(**case))[1] == failing, control


def test_the_last_page_over_credit_is_allowed_and_counted() -> None:
    """33 tokens, 2 pages held: the router credits 2 blocks (32 tokens), the engine reuses 16."""
    tally = Tally()
    assert first_failure(obs(33, 2 / 3, 16), tally) == (None, set())
    assert tally.last_page_overcredits == 1


def test_negative_control_the_same_difference_off_the_boundary_fails() -> None:
    """40 tokens is no EAGLE boundary ((40-1) % 16 != 0): one block over is a real disagreement."""
    assert first_failure(obs(40, 2 / 3, 16, held=1))[0] == "router_credits_engine_reuse"


def test_a_rate_over_another_denominator_fails_the_user_check() -> None:
    assert first_failure(obs(rate=2 / 3 + 1e-9))[0] == "router_credits_engine_reuse"


def test_a_hop_faulted_request_is_counted_not_judged_by_the_user_check() -> None:
    tally = Tally()
    evaluate(obs(rate=0.0, predicted=0, faulted=True), tally)
    assert tally.hop_faulted == 1 and tally.checked["router_credits_engine_reuse"] == 0
    assert tally.failed["router_matches_prediction"] == 0


def test_an_unknown_worker_is_a_finding() -> None:
    assert first_failure(obs(label=None))[0] == "router_credits_engine_reuse"
