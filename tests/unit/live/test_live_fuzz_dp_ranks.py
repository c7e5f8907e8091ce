"""The fuzz's per-rank checks and figures on data-parallel workers (kvalign/live/runs/fuzz/dp_ranks.py),
on a driver without a cluster: the live run is tests/e2e/test_fuzz_dp.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvalign.live.runs.fuzz.dp_ranks import CREDIT, ROUTED_RANK_SERVED, DpRanks
from kvalign.live.runs.fuzz.options import FuzzOptions
from kvalign.live.runs.fuzz.invariants import Observation, Tally
from kvalign.live.wire.client import Completion

B = 16
LABELS = ["worker0.dp0", "worker0.dp1"]


def ranks(held: dict[str, int], published: dict[str, int] | None = None, before: dict[str, int] | None = None) -> DpRanks:
    """A DpRanks over a driver whose engine views hold ``held`` pages of any prompt per rank now, and
    ``before`` at the routing mark."""
    counts = published if published is not None else dict.fromkeys(LABELS, 3)
    at_mark = before or {}
    driver = SimpleNamespace(labels=LABELS, tally=Tally(), engine_views=None,
                             _held_now=lambda label, tokens, salt=None: held.get(label, 0),
                             _held=lambda views, label, tokens, lo, hi=None, salt=None: [at_mark.get(label, 0)],
                             cluster=SimpleNamespace(capture=SimpleNamespace(count=lambda label: counts.get(label, 0))))
    return DpRanks(driver)


def observation(label: str, *, stored: int, credited_blocks: int = 2, n: int = 65) -> Observation:
    c = Completion(n, credited_blocks * B, [1], 7, 7, credited_blocks / -(-n // B), prefill_dp_rank=int(label[-1]))
    obs = Observation(1, list(range(n)), c, label, False, B, True, credited_blocks, credited_blocks, credited_blocks * B)
    obs.stored_pages, obs.engine_marks = stored, dict.fromkeys(LABELS, 1)
    return obs


def judged(r: DpRanks, obs: Observation, *, credit_checked: bool = True) -> list[tuple[str, str]]:
    before = (r.driver.tally.checked[CREDIT], r.driver.tally.failed[CREDIT])
    r.driver.tally.checked[CREDIT] += credit_checked
    return r.judge(obs, [], before)


def test_a_request_served_by_its_routed_rank_passes_and_is_counted_on_that_rank():
    r = ranks({"worker0.dp1": 4})
    assert judged(r, observation("worker0.dp1", stored=4)) == []
    assert r.figures.requests_by_rank() == {"worker0.dp0": 0, "worker0.dp1": 1}
    assert r.figures.by_rank()["worker0.dp1"] == {"checked": 1, "failed": 0, "credited_requests": 1}
    assert (r.driver.tally.checked[ROUTED_RANK_SERVED], r.driver.tally.failed[ROUTED_RANK_SERVED]) == (1, 0)


def test_pages_stored_on_another_rank_than_the_routed_one_fail_routed_rank_served():
    r = ranks({"worker0.dp0": 4, "worker0.dp1": 0})
    [(name, detail)] = judged(r, observation("worker0.dp1", stored=0))
    assert name == ROUTED_RANK_SERVED
    assert "routed it to worker0.dp1" in detail and "worker0.dp0's stream stored the prompt's pages" in detail


def test_a_request_no_stream_shows_is_left_to_the_engine_check():
    r = ranks({})
    assert judged(r, observation("worker0.dp1", stored=0)) == []
    assert r.driver.tally.checked[ROUTED_RANK_SERVED] == 0


def test_pages_another_rank_held_before_the_request_say_nothing_about_who_served_it():
    """The same prompt ran on rank 0 earlier: rank 0's stream showing it proves nothing about this request."""
    r = ranks({"worker0.dp0": 4, "worker0.dp1": 0}, before={"worker0.dp0": 4})
    assert judged(r, observation("worker0.dp1", stored=0)) == []
    assert r.driver.tally.checked[ROUTED_RANK_SERVED] == 0


def test_a_rank_that_reused_pages_it_never_published_this_example_is_the_cause():
    r = ranks({})
    r.driver.engine_views = SimpleNamespace(since_epoch=lambda label: [] if label == "worker0.dp1" else ["a batch"])
    assert r.cause(observation("worker0.dp1", stored=0)) == "DP_RANK_UNPUBLISHED"
    assert r.cause(observation("worker0.dp0", stored=0)) is None  # its stream carried batches
    quiet = observation("worker0.dp1", stored=0)
    quiet.engine_tokens = 0  # nothing reused: nothing it should have published
    assert r.cause(quiet) is None


def test_the_invariants_json_splits_the_credit_check_by_rank():
    r = ranks({"worker0.dp0": 4})
    judged(r, observation("worker0.dp0", stored=4))
    out = r.invariants_json(r.driver.tally.as_json())
    assert out[CREDIT]["by_rank"]["worker0.dp0"]["checked"] == 1 and out[ROUTED_RANK_SERVED] == {"checked": 1, "failed": 0}


@pytest.mark.parametrize("changes, message", [
    (dict(workers=1), "at least 2 workers or data-parallel ranks"),
    (dict(workers=1, dp_size=2, topology="disagg"), "aggregated workers behind one router"),
    (dict(workers=1, dp_size=2, routers=2), "aggregated workers behind one router"),
    (dict(workers=2, rank0_only=True), "needs --dp-size 2"),
])
def test_fuzz_options_refuse_what_the_rank_checks_do_not_cover(changes: dict[str, Any], message: str):
    with pytest.raises(ValueError, match=message):
        FuzzOptions(**changes)


def test_one_worker_with_two_ranks_is_a_fuzz_and_says_so_in_its_script():
    opts = FuzzOptions(workers=1, dp_size=2, rank0_only=True)
    assert opts.as_json()["dp_size"] == 2 and opts.as_json()["rank0_only"] is True
    assert "dp_size" not in FuzzOptions().as_json()


def test_the_cli_takes_dp_size_and_the_control_flag():
    import argparse

    from kvalign.commands import fuzz

    parser = argparse.ArgumentParser()
    fuzz.register(parser.add_subparsers())
    args = parser.parse_args(["fuzz", "--dp-size", "2", "--only-rank0-publishes"])
    opts = fuzz._options(args, None)
    assert (opts.workers, opts.dp_size, opts.rank0_only) == (1, 2, True)
    replayed = fuzz._options(parser.parse_args(["fuzz"]), {"options": {"dp_size": 2, "workers": 1, "rank0_only": True}})
    assert (replayed.workers, replayed.dp_size, replayed.rank0_only) == (1, 2, True)


def test_a_sticky_follow_up_is_pinned_to_the_rank_that_served_its_base_prompt():
    from kvalign.live.runs.fuzz.dp_ranks import sticky_step

    driver = SimpleNamespace(labels=LABELS, history=["a", "b", "c"], served=["worker0.dp0", "worker0.dp1", None])
    step = sticky_step(driver, 4, 7, 16, 2)  # of 4 -> history[1], served by rank 1
    assert step == {"rule": "request", "prompt": {"kind": "follow_up", "of": 4, "seed": 7, "extra": 16},
                    "max_tokens": 2, "pin": 1}
    assert "pin" not in sticky_step(driver, 2, 7, 16, 2)  # a prompt no live rank served goes unpinned


def test_the_decode_window_reads_the_serving_ranks_samples_only():
    from kvalign.live.runs.fuzz.dp_ranks import rank_samples
    from kvalign.live.wire.metrics import Sample, MetricsSnapshot, spec_window

    def snap(verify: tuple[float, float], gauge: tuple[float, float]) -> MetricsSnapshot:
        return MetricsSnapshot([
            *(Sample("sglang:spec_verify_calls_total", (("dp_rank", str(r)),), v) for r, v in enumerate(verify)),
            *(Sample("sglang:spec_accept_length", (("dp_rank", str(r)),), v) for r, v in enumerate(gauge)),
            Sample("sglang:num_requests_total", (), 5.0)])

    before, after = snap((10, 4), (2.0, 1.0)), snap((12, 4), (2.0, 1.0))  # rank 0 served; rank 1's gauge is stale
    assert spec_window(before, [after]).accept_length == 1.5  # both ranks averaged: the failure seen live
    window = spec_window(rank_samples(before, 0), [rank_samples(after, 0)])
    assert window.accept_length == 2.0 and window.verify_calls == 2
    assert rank_samples(after, None) is after


def test_every_rank_sends_each_rank_a_prompt_and_its_follow_up_there():
    from kvalign.live.runs.fuzz.dp_ranks import run_every_rank

    steps: list[dict[str, Any]] = []
    driver = SimpleNamespace(labels=LABELS, history=[], served=[], opts=SimpleNamespace(page_size=B))

    def run_step(step: dict[str, Any]) -> None:  # the driver records what each request ran on
        steps.append(step)
        driver.history.append(step["prompt"])
        driver.served.append(LABELS[step["pin"]])

    driver.run_step = run_step
    run_every_rank(driver, 100, 40, 3)
    assert [(s["prompt"]["kind"], s["pin"]) for s in steps] == [("fresh", 0), ("follow_up", 0), ("fresh", 1), ("follow_up", 1)]
    assert steps[1]["prompt"]["of"] == 0 and steps[3]["prompt"]["of"] == 2 and steps[3]["prompt"]["extra"] == B + 1
