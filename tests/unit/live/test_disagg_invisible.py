"""Disaggregation is invisible (assertion 5) and the KV moved and was verified (assertion 6), judged
on recorded runs: each failure names its request and its cause, and each check has the negative
control that breaks exactly what it guards."""

from __future__ import annotations

import pytest

from kvalign.live.runs.disagg_invisible import (
    DecodeRecord,
    TransferRecord,
    invisible_failures,
    transfer_failures,
)
from kvalign.model.causes import Cause

# Four requests as the nixl run on this CPU recorded them (tokens, Δverify, Δgen per request).
AGG = [DecodeRecord(1, (28, 24, 27, 43, 15, 43, 48, 31, 22, 59), 5, 10),
       DecodeRecord(2, (64, 25, 46, 58, 64, 58, 64, 25, 9, 44), 5, 10),
       DecodeRecord(3, (25, 64, 58, 58, 64, 58, 64, 58, 64, 58), 5, 10),
       DecodeRecord(4, (25, 58, 58, 58, 64, 58, 64, 58, 64, 58), 5, 10)]
MOVED = [TransferRecord(n, "nixl", 1, 20480 * (n + 1) / 2**20, 20.0, (True,), 21) for n in range(1, 5)]


def _replace(records: list[DecodeRecord], n: int, **kw: object) -> list[DecodeRecord]:
    from dataclasses import replace

    return [replace(r, **kw) if r.request == n else r for r in records]


def test_equal_runs_are_invisible_and_a_verified_transfer_passes():
    assert invisible_failures(list(AGG), AGG, MOVED) == []
    assert transfer_failures(MOVED, checksum=True) == []


def test_one_token_apart_fails_naming_the_request_and_the_position():
    """The negative control: two recorded runs that differ by one token."""
    tokens = list(AGG[2].token_ids)
    tokens[7] = 33
    [d] = invisible_failures(_replace(AGG, 3, token_ids=tuple(tokens)), AGG, MOVED)
    assert d.request == 3 and "at position 7" in d.what
    # the KV arrived verified, so what differs is the rest of the hand-off or decode itself
    assert d.cause is Cause.DECODE_OUTPUT_DIVERGED
    assert d.line().startswith("request 3: output token ids differ") and "cause: DECODE_OUTPUT_DIVERGED" in d.line()


def test_a_shorter_answer_differs_at_its_end():
    [d] = invisible_failures(_replace(AGG, 1, token_ids=AGG[0].token_ids[:6]), AGG, MOVED)
    assert d.request == 1 and "at position 6" in d.what


def test_same_tokens_with_more_verify_steps_is_the_draft_state():
    """Decode needed more verify steps for the same output: its draft accepted fewer tokens."""
    [d] = invisible_failures(_replace(AGG, 2, verify_calls=9), AGG, MOVED)
    assert d.request == 2 and d.cause is Cause.DRAFT_STATE_NOT_TRANSFERRED
    assert "Δsglang:spec_verify_calls_total 9 on decode vs 5 aggregated" in d.what


def test_no_transfer_names_the_fake_backend_cause_on_both_assertions():
    """What ``--transfer fake`` recorded: no transfer observed, other tokens."""
    fake = [TransferRecord(n, "fake", 0, 0.0, None, (), 0, exported=False) for n in range(1, 5)]
    wrong = [_replace(AGG, n, token_ids=(339, 0, 54))[n - 1] for n in range(1, 5)]
    diverged = invisible_failures(wrong, AGG, fake)
    assert [d.request for d in diverged] == [1, 2, 3, 4]
    assert {d.cause for d in diverged} == {Cause.KV_NOT_TRANSFERRED}
    moved = transfer_failures(fake, checksum=False)
    assert [d.cause for d in moved] == [Cause.KV_NOT_TRANSFERRED] * 4
    assert "never observed on any prefill worker" in moved[0].what


def test_a_failed_checksum_is_named_and_an_aborted_request_diverges():
    """What ``--checksum-mismatch-prob 1`` recorded: bytes moved, SGLang's checksum failed, request aborted."""
    bad = [TransferRecord(1, "nixl", 1, 0.02, 55.0, (False,), 21)]
    [moved] = transfer_failures(bad, checksum=True)
    assert moved.cause is Cause.KV_CHECKSUM_MISMATCH and "1 of 1" in moved.what
    aborted = [DecodeRecord(1, (), 0, 1, error="server error in stream: 500")]
    [d] = invisible_failures(aborted, AGG[:1], bad)
    assert d.cause is Cause.KV_CHECKSUM_MISMATCH and "failed on the disaggregated cluster" in d.what


def test_a_checksum_that_verified_nothing_is_not_a_pass():
    [d] = transfer_failures([TransferRecord(1, "nixl", 1, 0.02, 5.0, (), 0)], checksum=True)
    assert d.cause is Cause.KV_NOT_TRANSFERRED and "verified nothing" in d.what
    assert transfer_failures([TransferRecord(1, "nixl", 1, 0.02, 5.0, (), 0)], checksum=False) == []


def test_missing_values_are_errors_naming_them_never_equality():
    with pytest.raises(ValueError, match="request 4 is missing from the disaggregated run"):
        invisible_failures(AGG[:3], AGG)
    with pytest.raises(ValueError, match="spec_verify_calls_total missing on the disaggregated decode worker"):
        invisible_failures(_replace(AGG, 1, verify_calls=None), AGG)
    with pytest.raises(ValueError, match="failed on the aggregated worker"):
        invisible_failures(AGG, _replace(AGG, 2, error="HTTP 500"))
