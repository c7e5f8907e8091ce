"""The router-credit-versus-engine-reuse measurement (approximate mode's figure, events mode's too)."""

from __future__ import annotations

from kvalign.live.runs.fuzz.credit_error import CreditError, summary


def test_summary_of_signed_errors():
    s = summary([0, 32, -16, 0, 48], 16)
    assert s["requests"] == 5 and s["exact"] == 2
    assert s["mean_abs_tokens"] == 19.2 and s["worst_abs_tokens"] == 48 and s["mean_abs_blocks"] == 1.2
    assert (s["overcredited"], s["overcredited_tokens"], s["undercredited"], s["undercredited_tokens"]) == (2, 80, 1, 16)
    assert summary([], 16)["mean_abs_tokens"] is None and summary([], 16)["worst_abs_tokens"] is None


def test_faulted_and_unreadable_requests_are_left_out_and_counted():
    ce = CreditError(16)
    ce.add(32, 32)
    ce.add(48, 0, hop_faulted=True)  # the hop lost the pages on purpose: the fault's error, not the mode's
    ce.add(None, 16)  # no exact credit (kv_hit_rate is no k/ceil(N/B))
    assert ce.errors == [0] and ce.skipped == 2


def test_workloads_are_named_by_their_steps():
    a, b = CreditError(16), CreditError(16)
    for ce, err in ((a, 16), (b, 0)):
        ce.begin_workload()
        ce.note_step({"rule": "request", "prompt": {"kind": "fresh", "seed": 1}, "max_tokens": 2})
        ce.add(16 + err, 16)
        ce.begin_workload()
        ce.note_step({"rule": "flush", "worker": 0})
    ja, jb = a.as_json()["by_workload"], b.as_json()["by_workload"]
    assert [w["workload"] for w in ja] == [w["workload"] for w in jb] and ja[0]["workload"] != ja[1]["workload"]
    assert ja[0]["worst_abs_tokens"] == 16 and jb[0]["worst_abs_tokens"] == 0 and ja[1]["requests"] == 0
