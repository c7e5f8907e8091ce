"""Which cause a tier search reports where the generated example's first run and Hypothesis's last run (or the
example it shrank to) named two: the one the generated example's recorded steps show most when replayed
(kvalign/verify/props/tier/body.py ``_cause_that_recurs``). The fast tier met it: under load an unknown-medium
control's example first failed TIER_MISFILED (a device removal Dynamo had not yet applied), every replay
MEDIUM_NOT_INDEXED (what the hop did)."""

from __future__ import annotations

from kvalign.model.causes import Cause
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.props.tier.body import CAUSE_REPLAYS, _cause_that_recurs


def _pair() -> tuple[Mismatch, Mismatch]:
    generated = Mismatch("tier", "generated", Cause.TIER_MISFILED, {"steps": [1, 2, 3]})
    final = Mismatch("tier", "final", Cause.MEDIUM_NOT_INDEXED, {"steps": [1, 2, 3]})
    return generated, final


def test_the_cause_the_replays_show_wins_over_the_first_runs() -> None:
    generated, final = _pair()
    replays: list[dict] = []

    def cause_of(example: dict) -> Cause:
        replays.append(example)
        return Cause.MEDIUM_NOT_INDEXED

    assert _cause_that_recurs(final, generated, cause_of) is final and final.detail == "final"
    assert replays == [generated.example] * CAUSE_REPLAYS


def test_negative_control_where_the_replays_show_the_generated_cause_it_is_reported_not_shrunk() -> None:
    generated, final = _pair()
    got = _cause_that_recurs(final, generated, lambda example: Cause.TIER_MISFILED)
    assert got is generated and got.cause is Cause.TIER_MISFILED
    assert got.detail == "generated (not shrunk: shrinking it reached another cause, MEDIUM_NOT_INDEXED)"


def test_agreeing_or_missing_mismatches_are_not_replayed() -> None:
    generated, final = _pair()

    def never(example: dict) -> Cause:
        raise AssertionError("replayed")

    assert _cause_that_recurs(generated, generated, never) is generated
    assert _cause_that_recurs(None, generated, never) is None and _cause_that_recurs(final, None, never) is final
    same = Mismatch("tier", "same", Cause.TIER_MISFILED, {"steps": [1]})
    assert _cause_that_recurs(same, generated, never) is same
