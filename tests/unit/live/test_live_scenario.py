"""The shared scenario's arithmetic and checks, on records shaped like live responses."""

from __future__ import annotations

import pytest

from kvalign.live.runs import scenario
from kvalign.live.wire.client import ChatResult
from kvalign.live.runs.scenario import RequestRecord


def _rec(i, n_tokens, worker, observed, overlap, decode=None, prompt_tokens=None, rank=None):
    res = ChatResult(prefill_worker_id=worker, decode_worker_id=decode if decode is not None else worker,
                     timing={"ttft_ms": 2.0, "total_time_ms": 5.0, "kv_hit_rate": observed},
                     usage={"prompt_tokens": n_tokens if prompt_tokens is None else prompt_tokens}, done=True,
                     prefill_dp_rank=rank)
    return RequestRecord(i, list(range(n_tokens)), True, {(worker, rank or 0): overlap} if overlap else {}, res, 16)


# The live eagle run at B=16: 21/39/57/75 tokens, overlap 0/1/2/3 -> 0, 1/3, 1/2, 3/5.
LIVE = [_rec(0, 21, 5, 0.0, 0), _rec(1, 39, 5, 1 / 3, 1), _rec(2, 57, 5, 0.5, 2), _rec(3, 75, 5, 0.6, 3)]


def test_live_shaped_records_pass_every_check():
    for check in (scenario.check_timing, scenario.check_prompt_tokens, scenario.check_hit_positive, scenario.check_prediction):
        check(LIVE)
    assert scenario.check_same_worker(LIVE) == 5
    assert [r.predicted for r in LIVE] == [r.observed for r in LIVE]
    assert "0.3333" in scenario.table(LIVE)


@pytest.mark.parametrize("records, check, msg", [
    ([LIVE[0], _rec(1, 39, 6, 1 / 3, 1)], scenario.check_same_worker, "left request 1's worker 5"),
    ([LIVE[0], _rec(1, 39, 5, 0.0, 0)], scenario.check_hit_positive, "not > 0 on requests \\[2\\]"),
    ([LIVE[0], _rec(1, 39, 5, 1.0, 1)], scenario.check_prediction, "differ by 2.00 blocks"),
    ([LIVE[0], _rec(1, 39, 5, 1 / 3, 1, prompt_tokens=40)], scenario.check_prompt_tokens, "40 prompt tokens, kvalign 39"),
    (LIVE, scenario.check_hit_zero, "should stay 0"),
])
def test_each_check_fails_with_the_numbers(records, check, msg):
    with pytest.raises(AssertionError, match=msg) as e:
        check(records)
    assert "kv_hit_rate" in str(e.value)  # the table rides along


def test_prediction_tolerance_is_in_blocks():
    off_by_one = [_rec(0, 39, 5, 2 / 3, 1)]
    scenario.check_prediction(off_by_one, tolerance_blocks=1)
    with pytest.raises(AssertionError, match="differ by 1.00 blocks"):
        scenario.check_prediction(off_by_one, tolerance_blocks=0)


def test_disaggregated_checks():
    recs = [_rec(i, 21 + 18 * i, 5, 0.0, 0, decode=9) for i in range(2)]
    scenario.check_not_decode(recs, {9})
    with pytest.raises(AssertionError, match="prefilled on a decode worker"):
        scenario.check_not_decode(recs, {5, 9})
    with pytest.raises(AssertionError, match="decode ran outside"):
        scenario.check_not_decode(recs, {8})


def test_missing_fields_fail_instead_of_passing():
    bare = RequestRecord(0, [1] * 20, True, {}, ChatResult(prefill_worker_id=None, done=True), 16)
    for check, msg in ((scenario.check_timing, "no nvext.timing"), (scenario.check_same_worker, "no nvext.worker_id"),
                       (scenario.check_prompt_tokens, "no usage.prompt_tokens"), (scenario.check_prediction, "missing kv_hit_rate")):
        with pytest.raises(AssertionError, match=msg):
            check([bare])


def test_data_parallel_records_are_predicted_and_held_to_one_rank():
    """With --dp-size the router's choice is (worker, rank): the prediction is that rank's overlap, and
    a request sent to the worker's other rank left request 1's cache."""
    ranked = [_rec(0, 21, 5, 0.0, 0, rank=1), _rec(1, 39, 5, 1 / 3, 1, rank=1)]
    scenario.check_prediction(ranked)
    assert scenario.check_same_worker(ranked) == 5 and "5/dp1" in scenario.table(ranked)
    moved = [*ranked, _rec(2, 57, 5, 0.0, 0, rank=0)]
    with pytest.raises(AssertionError, match=r"requests \[3\] left request 1's worker 5 rank 1"):
        scenario.check_same_worker(moved)
