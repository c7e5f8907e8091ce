"""The fuzz's Hypothesis wiring (kvalign/live/runs/fuzz/machine.py), on a recording driver.

No cluster here: the driver only records steps (and fails on demand), which is enough to hold
what the live run relies on — the default seed draws every rule, a failure is shrunk to a minimal
step list and written as a replay script, and a replay runs the script's steps as one example.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvalign.commands.fuzz import DEFAULT_SEED, DISAGG_SEED, DISAGG_SHORT, HICACHE_SEED, ROUTERS_SEED
from kvalign.live.runs.fuzz.driver import COUNTS
from kvalign.live.runs.fuzz.options import FuzzEnvironmentError, FuzzOptions
from kvalign.live.runs.fuzz.invariants import InvariantFailed, Tally
from kvalign.live.runs.fuzz.machine import replay, run_fuzz

RULES = {"request", "concurrent", "flush", "fill", "drop_batch", "restart"}


class RecordingDriver:
    """The part of FuzzDriver the machine calls; ``fail_on(step)`` decides a failure."""

    def __init__(self, fail_on: Any = None) -> None:
        self.opts, self.labels, self.disagg = FuzzOptions(), ["worker0", "worker1"], False
        self.fail_on = fail_on
        self.examples = self.steps_run = self.requests = self.unsettled = self.restarts_in_example = 0
        self.steps: list[dict] = []
        self.observed: list[dict] = []
        self.tally, self.counts = Tally(), dict.fromkeys(COUNTS, 0)
        self.all_steps: list[list[dict]] = []

    example_failed = False  # the machine's teardown judges the example's end only when no step raised

    def begin_example(self) -> None:
        self.examples += 1
        self.steps, self.restarts_in_example = [], 0
        self.all_steps.append(self.steps)

    def end_example(self) -> None:
        pass

    def run_step(self, step: dict) -> None:
        self.steps.append(step)
        self.steps_run += 1
        self.restarts_in_example += step["rule"] == "restart"
        if self.fail_on and self.fail_on(step):
            raise InvariantFailed("router_matches_prediction", "made up", cause="ROUTER_EAGLE_OFF")


def test_default_seed_draws_every_rule_in_three_examples() -> None:
    d = RecordingDriver()
    res = run_fuzz(d, examples=3, steps=10, seed=DEFAULT_SEED, shrink_seconds=10, script_path=Path("/nonexistent"),
                   report=lambda _m: None)
    assert res.failure is None
    drawn = Counter(s["rule"] for ex in d.all_steps for s in ex)
    assert set(drawn) == RULES, drawn
    assert all(sum(s["rule"] == "restart" for s in ex) <= 1 for ex in d.all_steps)


class ReplicaFaults:
    """The part of FuzzReplicas the machine reads: replica faults drawn in this example."""

    faults_in_example = 0


class ReplicaRecordingDriver(RecordingDriver):
    """A recording driver with router replicas (``--routers 2``): two more rules."""

    def __init__(self) -> None:
        super().__init__()
        self.replicas = ReplicaFaults()

    def begin_example(self) -> None:
        super().begin_example()
        self.replicas.faults_in_example = 0

    def run_step(self, step: dict) -> None:
        super().run_step(step)
        self.replicas.faults_in_example += step["rule"] in ("restart_router", "interrupt_events")


def test_the_replica_seed_draws_every_rule_and_both_replica_faults_with_one_restart() -> None:
    d = ReplicaRecordingDriver()
    res = run_fuzz(d, examples=3, steps=10, seed=ROUTERS_SEED, shrink_seconds=10, script_path=Path("/nonexistent"),
                   report=lambda _m: None)
    assert res.failure is None
    drawn = Counter(s["rule"] for ex in d.all_steps for s in ex)
    assert set(drawn) == RULES | {"restart_router", "interrupt_events"} and drawn["restart"] == 1, drawn
    assert all(sum(s["rule"] in ("restart_router", "interrupt_events") for s in ex) <= 1 for ex in d.all_steps)


def test_without_replicas_the_machine_draws_no_replica_fault() -> None:
    d = RecordingDriver()
    run_fuzz(d, examples=3, steps=10, seed=ROUTERS_SEED, shrink_seconds=10, script_path=Path("/nonexistent"),
             report=lambda _m: None)
    assert not {"restart_router", "interrupt_events"} & {s["rule"] for ex in d.all_steps for s in ex}


def test_a_failure_is_shrunk_to_its_minimal_steps_and_written_as_a_script(tmp_path: Path) -> None:
    d = RecordingDriver(fail_on=lambda s: s["rule"] == "flush")
    script = tmp_path / "fuzz-failure.json"
    res = run_fuzz(d, examples=20, steps=10, seed=1, shrink_seconds=30, script_path=script, report=lambda _m: None)
    assert res.failure is not None and res.failure.invariant == "router_matches_prediction"
    assert res.failure.cause == "ROUTER_EAGLE_OFF" and res.failure.script == str(script)
    saved = json.loads(script.read_text())
    assert saved["kvalign_fuzz_script"] == 1 and saved["failure"]["invariant"] == "router_matches_prediction"
    assert saved["steps"] == [{"rule": "flush", "worker": 0}]  # shrunk: the one failing step, worker 0


def test_negative_control_a_driver_that_never_fails_passes(tmp_path: Path) -> None:
    d = RecordingDriver(fail_on=lambda s: False)
    res = run_fuzz(d, examples=5, steps=5, seed=1, shrink_seconds=5, script_path=tmp_path / "x.json", report=lambda _m: None)
    assert res.passed and not (tmp_path / "x.json").exists()


def test_replay_runs_the_script_steps_as_one_example(tmp_path: Path) -> None:
    steps = [{"rule": "request", "prompt": {"kind": "fresh", "seed": 0, "length": 3}, "max_tokens": 1},
             {"rule": "flush", "worker": 1}]
    d = RecordingDriver(fail_on=lambda s: s["rule"] == "flush")
    res = replay(d, {"steps": steps}, tmp_path / "replayed.json")
    assert d.examples == 1 and d.steps == steps
    assert res.failure is not None and res.failure.script == str(tmp_path / "replayed.json")
    assert json.loads((tmp_path / "replayed.json").read_text())["steps"] == steps


class EndJudgingDriver(RecordingDriver):
    """Speculation as the driver judges it in windows: a request asked for 12 tokens or more runs on a
    draft the target disagrees with, and its window is still open when the example ends."""

    def end_example(self) -> None:
        requests = [i + 1 for i, s in enumerate(self.steps) if s["rule"] == "request" and s["max_tokens"] >= 12]
        if requests:
            raise InvariantFailed("decode_keeps_speculating", f"requests {requests} on worker0: not > 1.2",
                                  request=requests[-1])


# slow: 3.6 s CPU (-n 0) of shrinking for up to 20 s, not a control. Shrinking a failure to a script stays proven in
# the fast tier by test_a_failure_is_shrunk_to_its_minimal_steps_and_written_as_a_script, judging at the example's
# end by test_a_replay_judges_the_examples_end and its negative control; the two together, in the full suite.
@pytest.mark.slow
def test_a_failure_judged_at_the_examples_end_is_shrunk_and_written_as_a_script(tmp_path: Path) -> None:
    """It may shrink less far than a step's failure (measured: 1 to 5 steps, varying with the time
    Hypothesis's shrinker gets), always to a script that ends with a request its window fails on."""
    script = tmp_path / "fuzz-failure.json"
    res = run_fuzz(EndJudgingDriver(), examples=5, steps=10, seed=DEFAULT_SEED, shrink_seconds=20,
                   script_path=script, report=lambda _m: None)
    assert res.failure is not None and res.failure.invariant == "decode_keeps_speculating" and not res.failure.flaky
    steps = json.loads(script.read_text())["steps"]
    assert len(steps) <= 5 and steps[-1]["rule"] == "request" and steps[-1]["max_tokens"] >= 12, steps


def test_negative_control_the_examples_end_is_not_judged_after_a_step_failed(tmp_path: Path) -> None:
    d = EndJudgingDriver(fail_on=lambda s: True)
    d.example_failed = True  # what FuzzDriver.run_step sets when a step raises
    res = run_fuzz(d, examples=3, steps=10, seed=DEFAULT_SEED, shrink_seconds=5, script_path=tmp_path / "x.json",
                   report=lambda _m: None)
    assert res.failure is not None and res.failure.invariant == "router_matches_prediction"


def test_a_replay_judges_the_examples_end(tmp_path: Path) -> None:
    steps = [{"rule": "request", "prompt": {"kind": "fresh", "seed": 1, "length": 40}, "max_tokens": 12}]
    res = replay(EndJudgingDriver(), {"steps": steps}, tmp_path / "replayed.json")
    assert res.failure is not None and res.failure.invariant == "decode_keeps_speculating"
    assert json.loads((tmp_path / "replayed.json").read_text())["steps"] == steps


class BreakingDriver(RecordingDriver):
    """Raises the environment error on the ``n``-th step (a cluster that dies mid-run)."""

    def __init__(self, n: int, fail_on: Any = None) -> None:
        super().__init__(fail_on)
        self.n = n

    def run_step(self, step: dict) -> None:
        if self.steps_run + 1 >= self.n:
            self.steps_run += 1
            raise FuzzEnvironmentError("request of 40 tokens failed: HTTP 400")
        super().run_step(step)


def test_a_broken_environment_is_an_environment_error_not_a_hypothesis_one(tmp_path: Path) -> None:
    d = BreakingDriver(3)
    with pytest.raises(FuzzEnvironmentError, match="HTTP 400"):
        run_fuzz(d, examples=3, steps=10, seed=DEFAULT_SEED, shrink_seconds=5, script_path=tmp_path / "x.json",
                 report=lambda _m: None)


def test_an_environment_error_while_shrinking_keeps_the_failure_already_found(tmp_path: Path) -> None:
    d = BreakingDriver(4, fail_on=lambda s: True)  # fails on the first step, breaks on the 4th (shrinking)
    script = tmp_path / "fuzz-failure.json"
    res = run_fuzz(d, examples=3, steps=10, seed=DEFAULT_SEED, shrink_seconds=5, script_path=script,
                   report=lambda _m: None)
    assert res.failure is not None and res.failure.invariant == "router_matches_prediction"
    assert res.failure.note and "shrinking stopped" in res.failure.note and script.exists()


class TwoFailuresDriver(RecordingDriver):
    """A blind router: every flush fails the user's invariant, and any drop_batch fails routing."""

    def run_step(self, step: dict) -> None:
        self.steps.append(step)
        self.steps_run += 1
        if step["rule"] == "flush":
            raise InvariantFailed("router_credits_engine_reuse", "router 0, engine 48", cause="ROUTER_EAGLE_OFF",
                                  numbers={"router_tokens": 0, "engine_tokens": 48})
        if step["rule"] == "drop_batch":
            raise InvariantFailed("best_worker_chosen", "blind routing", cause="ROUTER_EAGLE_OFF")


def test_the_reported_failure_is_the_first_invariant_seen_not_the_shortest(tmp_path: Path) -> None:
    """Hypothesis shrinks towards any failure; the report keeps the user's question first."""
    script = tmp_path / "fuzz-failure.json"
    res = run_fuzz(TwoFailuresDriver(), examples=20, steps=10, seed=1, shrink_seconds=20, script_path=script,
                   report=lambda _m: None)
    assert res.failure is not None and res.failure.invariant == "router_credits_engine_reuse"
    assert res.failure.as_json()["router_tokens"] == 0 and res.failure.as_json()["engine_tokens"] == 48
    saved = json.loads(script.read_text())
    assert saved["failure"]["invariant"] == "router_credits_engine_reuse"
    assert any(s["rule"] == "flush" for s in saved["steps"])


@pytest.mark.parametrize("seed, examples, steps", [(DISAGG_SEED, 3, 10), DISAGG_SHORT], ids=["default", "short"])
def test_the_disaggregated_ci_seed_draws_every_rule_but_bursts_with_one_restart(seed, examples, steps) -> None:
    d = RecordingDriver()
    d.disagg = True
    run_fuzz(d, examples=examples, steps=steps, seed=seed, shrink_seconds=5, script_path=Path("/nonexistent"),
             report=lambda _m: None)
    drawn = Counter(s["rule"] for ex in d.all_steps for s in ex)
    assert set(drawn) == RULES - {"concurrent"} and drawn["restart"] == 1, drawn


class HiCacheRecordingDriver(RecordingDriver):
    def __init__(self) -> None:
        from kvalign.live.engines.hicache import HiCache

        super().__init__()
        self.opts, self.host_evictions_in_example = FuzzOptions(hicache=HiCache()), 0

    def begin_example(self) -> None:
        super().begin_example()
        self.host_evictions_in_example = 0


def _host_pages_in_cap(step: dict) -> int:
    """An offload's host-only pages inside the scheduler's cap (its tail of 0 leaves the last page out)."""
    return step["ext"] - (step["tail"] == 0)


def test_the_hicache_seed_draws_every_rule_but_bursts_and_host_stretches_on_both_sides_of_the_threshold() -> None:
    d = HiCacheRecordingDriver()
    run_fuzz(d, examples=3, steps=10, seed=HICACHE_SEED, shrink_seconds=5, script_path=Path("/nonexistent"),
             report=lambda _m: None)
    steps = [s for ex in d.all_steps for s in ex]
    assert set(Counter(s["rule"] for s in steps)) == RULES - {"concurrent"} | {"offload", "evict_host"}
    assert all(sum(s["rule"] == "restart" for s in ex) <= 1 for ex in d.all_steps)
    offloads = [_host_pages_in_cap(s) for s in steps if s["rule"] == "offload"]
    assert any(0 < h * 4 < 10 for h in offloads), offloads  # page 4: below SGLang's load_back_threshold
    assert any(h * 16 >= 10 for h in offloads), offloads  # page 16: above it
    assert all(sum(s["rule"] == "evict_host" for s in ex) <= 1 for ex in d.all_steps)


def test_negative_control_without_hicache_no_hicache_rule_is_drawn() -> None:
    d = RecordingDriver()
    run_fuzz(d, examples=3, steps=10, seed=HICACHE_SEED, shrink_seconds=5, script_path=Path("/nonexistent"),
             report=lambda _m: None)
    assert not {s["rule"] for ex in d.all_steps for s in ex} & {"offload", "evict_host"}


class TimingDriver(RecordingDriver):
    """Fails once, on the first flush, as a race does (the engine's stores came after the request was
    routed), and never again: the live replay of the same steps passes."""

    def run_step(self, step: dict) -> None:
        self.steps.append(step)
        self.steps_run += 1
        if step["rule"] == "flush" and not getattr(self, "failed_once", False):
            self.failed_once = True
            exc = InvariantFailed("engine_matches_index", "engine reused 64, its view says 48", cause="ENGINE_EVENTS_LATE")
            exc.failing = ["engine_matches_index", "router_credits_engine_reuse"]
            exc.evidence = {"kind": "late", "pages": [3, 3], "seq": 7,
                            "capture": "/run/failures/request-3/engine.capture.jsonl",
                            "replay": "kvalign diagnose --capture /run/failures/request-3/engine.capture.jsonl "
                                      "--prompt /run/failures/request-3/prompt.json --engine-reused 64 --routed-at-batch 6"}
            raise exc


def test_a_failure_that_depends_on_timing_keeps_its_cause_from_the_recorded_stream(tmp_path: Path) -> None:
    """Hypothesis cannot reproduce it (Flaky); the report still names the cause, says how it was named
    (the stream recorded when it failed) and how to replay that stream, never a bare "flaky"."""
    script = tmp_path / "fuzz-failure.json"
    res = run_fuzz(TimingDriver(), examples=20, steps=10, seed=1, shrink_seconds=20, script_path=script,
                   report=lambda _m: None)
    f = res.failure.as_json()
    assert f["flaky"] is True and f["cause"] == "ENGINE_EVENTS_LATE"
    assert "did not reproduce" in f.get("note", "") and "kvalign diagnose --capture" in f["note"], f
    assert f["evidence"]["kind"] == "late" and f["failing"] == ["engine_matches_index", "router_credits_engine_reuse"]
    saved = json.loads(script.read_text())["failure"]
    assert saved["evidence"]["replay"] == f["evidence"]["replay"] and saved["failing"] == f["failing"]


def test_a_failure_reports_every_invariant_the_request_failed(tmp_path: Path) -> None:
    d = RecordingDriver(fail_on=lambda s: s["rule"] == "flush")
    res = run_fuzz(d, examples=20, steps=10, seed=1, shrink_seconds=10, script_path=tmp_path / "f.json",
                   report=lambda _m: None)
    assert res.failure.as_json()["failing"] == ["router_matches_prediction"]


class StorageRecordingDriver(HiCacheRecordingDriver):
    def __init__(self) -> None:
        from kvalign.live.engines.hicache import HiCache

        super().__init__()
        self.opts, self.storage_refills_in_example = FuzzOptions(hicache=HiCache(storage="file")), 0

    def begin_example(self) -> None:
        super().begin_example()
        self.storage_refills_in_example = 0


def test_with_a_storage_tier_the_hicache_seed_also_draws_refill_storage_once_per_example() -> None:
    d = StorageRecordingDriver()
    run_fuzz(d, examples=3, steps=10, seed=HICACHE_SEED, shrink_seconds=5, script_path=Path("/nonexistent"),
             report=lambda _m: None)
    drawn = Counter(s["rule"] for ex in d.all_steps for s in ex)
    assert drawn["refill_storage"] >= 1, drawn
    assert all(sum(s["rule"] == "refill_storage" for s in ex) <= 1 for ex in d.all_steps)
    # negative control: the HiCache run without storage draws it never (HiCacheRecordingDriver, above)
    plain = HiCacheRecordingDriver()
    run_fuzz(plain, examples=3, steps=10, seed=HICACHE_SEED, shrink_seconds=5, script_path=Path("/nonexistent"),
             report=lambda _m: None)
    assert "refill_storage" not in {s["rule"] for ex in plain.all_steps for s in ex}
