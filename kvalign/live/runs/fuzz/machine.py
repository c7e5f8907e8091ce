"""The Hypothesis state machine over a live cluster, the run loop, and its one JSON result.

Each Hypothesis example is one workload on the *same* running cluster: the machine's constructor
flushes every worker (:meth:`FuzzDriver.begin_example`) instead of restarting the cluster, so
examples cost seconds, and shrinking replays candidate workloads on it too. Rules draw JSON-able
steps and hand them to the driver, which checks every answered request before the next rule runs.
A failing example is shrunk by Hypothesis (bounded by ``shrink_seconds``), and the steps of the
last failing run — the shrunk one — are written as a replay script with the captures kept. The
speculation windows still open when an example ends are judged in the machine's ``teardown``; a
failure there shrinks less far than one a step raises (Hypothesis cannot cut the steps after it,
there are none, and kept up to four steps before the failing request in a fake driver's runs), and
the report names the window's requests, so ``--replay SCRIPT --spec-window 1`` judges each alone.
Judging alone only while shrinking is no way out: Hypothesis refuses a replay that fails earlier than
the run it replays (``FlakyStrategyDefinition``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from kvalign.live.runs.fuzz.driver import FuzzDriver
from kvalign.live.runs.fuzz.options import FuzzEnvironmentError, FuzzOptions
from kvalign.live.runs.fuzz.invariants import INVARIANTS, InvariantFailed
from kvalign.live.runs.fuzz.prompts import lengths, max_tokens, prompt_specs


@dataclass
class Failure:
    """The shrunk counterexample: what broke, why, and where its replay script is."""

    invariant: str
    cause: str
    detail: str
    script: str
    flaky: bool = False
    numbers: dict[str, Any] = field(default_factory=dict)  # router_tokens, engine_tokens
    note: str | None = None  # e.g. why shrinking stopped early
    failing: list[str] = field(default_factory=list)  # every invariant the request failed, ``invariant`` first
    evidence: dict[str, Any] | None = None  # the recorded stream the cause was named from, and its replay

    def as_json(self) -> dict[str, Any]:
        return {"invariant": self.invariant, "failing": self.failing or [self.invariant], "cause": self.cause,
                "detail": self.detail, "script": self.script, **self.numbers, **({"flaky": True} if self.flaky else {}),
                **({"note": self.note} if self.note else {}), **({"evidence": self.evidence} if self.evidence else {})}

    @classmethod
    def of(cls, exc: InvariantFailed, script: str, *, flaky: bool = False, note: str | None = None) -> "Failure":
        return cls(exc.invariant, exc.cause, exc.detail, script, flaky, exc.numbers, note, exc.failing, exc.evidence)


@dataclass
class FuzzResult:
    """What ``kvalign e2e fuzz --json`` prints."""

    driver: FuzzDriver
    failure: Failure | None = None
    seconds: float = 0.0
    startup_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.failure is None

    def as_json(self) -> dict[str, Any]:
        d = self.driver
        return {
            "verdict": "pass" if self.passed else "fail",
            "topology": d.opts.topology, "sglang": getattr(d.cluster.kind, "sglang_version", None),  # None on vLLM workers
            "examples": d.examples, "steps": d.steps_run, "requests": d.requests,
            "counts": d.finish_counts(),
            "invariants": d.invariants_json(),
            "last_page_overcredits": d.tally.last_page_overcredits, "unattributable": d.tally.unattributable,
            "hop_faulted": d.tally.hop_faulted,
            **({"host_requeries": d.host_requeries} if d.opts.hicache else {}),
            **({"storage_refills": d.storage_refills} if d.opts.hicache and d.opts.hicache.storage else {}),
            "failure": None if self.failure is None else self.failure.as_json(),
            "options": d.opts.as_json(), "startup_s": round(self.startup_s, 1), "seconds": round(self.seconds, 1),
            "requests_per_minute": round(60 * d.requests / self.seconds, 1) if self.seconds > 0 else None,
            "unsettled_waits": d.unsettled, "peak_rss_gib": round(d.peak_rss_bytes / 2**30, 2),
            "router_mode": d.opts.router_mode, "credit_error": None if d.credit_error is None else d.credit_error.as_json(),
            **({} if getattr(d, "replicas", None) is None else {"routers": d.replicas.as_json()}),
            **({} if getattr(d, "transfers", None) is None else {"transfers": d.transfers.as_json()}),
            "notes": [*self.notes, *d.notes], "run_dir": str(d.cluster.plan.run_dir),
        }


def write_script(path: Path, opts: FuzzOptions, steps: list[dict[str, Any]], failure: InvariantFailed | None,
                 observed: list[dict[str, Any]]) -> None:
    """The replayable script: the options, the steps (with their faults) and what was seen."""
    path.write_text(json.dumps({
        "kvalign_fuzz_script": 1, "options": opts.as_json(), "steps": steps,
        "failure": None if failure is None else {"invariant": failure.invariant, "failing": failure.failing,
                                                 "cause": failure.cause, "detail": failure.detail,
                                                 **({"evidence": failure.evidence} if failure.evidence else {})},
        "observed": observed,
    }, indent=1) + "\n")


def machine_class(driver: FuzzDriver) -> type[RuleBasedStateMachine]:
    """The state machine bound to one live driver (strategies depend on its page size and workers)."""
    b, n = driver.opts.page_size, len(driver.labels)
    specs, fresh = prompt_specs(b), st.fixed_dictionaries(
        {"kind": st.just("fresh"), "seed": st.integers(0, 2**16), "length": lengths(b).filter(lambda k: k > 2 * b + 1)})
    worker = st.integers(0, n - 1)

    class LiveFuzz(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            driver.begin_example()

        def teardown(self) -> None:
            if not driver.example_failed:  # the last speculation windows: a failure here is the example's
                driver.end_example()

        @rule(prompt=specs, mt=max_tokens())
        def request(self, prompt: dict, mt: int) -> None:
            driver.run_step({"rule": "request", "prompt": prompt, "max_tokens": mt})

        # prefill reuse (disagg) and the router's raw credit per tier (HiCache) are counters: a burst merges them
        @precondition(lambda self: not driver.disagg and not driver.opts.hicache)
        @rule(reqs=st.lists(st.tuples(specs, max_tokens()), min_size=2, max_size=3))
        def concurrent(self, reqs: list) -> None:
            driver.run_step({"rule": "concurrent", "requests": [list(r) for r in reqs]})

        @rule(w=worker)
        def flush(self, w: int) -> None:
            driver.run_step({"rule": "flush", "worker": w})

        @rule(seed=st.integers(0, 2**16))
        def fill(self, seed: int) -> None:
            driver.run_step({"rule": "fill", "seed": seed})

        @rule(prompt=fresh, mt=max_tokens())
        def drop_batch(self, prompt: dict, mt: int) -> None:
            driver.run_step({"rule": "drop_batch", "prompt": prompt, "max_tokens": mt})

        @precondition(lambda self: driver.restarts_in_example == 0)
        @rule(w=worker)
        def restart(self, w: int) -> None:
            driver.run_step({"rule": "restart", "worker": w})

        if getattr(driver, "replicas", None) is not None:  # router replicas: at most one replica fault per example
            @precondition(lambda self: driver.replicas.faults_in_example == 0)
            @rule(r=st.integers(0, 2**8))
            def restart_router(self, r: int) -> None:
                driver.run_step({"rule": "restart_router", "router": r})

            @precondition(lambda self: driver.replicas.faults_in_example == 0)
            @rule(w=worker, seed=st.integers(0, 2**16))
            def interrupt_events(self, w: int, seed: int) -> None:
                driver.run_step({"rule": "interrupt_events", "worker": w, "seed": seed})

    if driver.opts.dp_size > 1:
        from kvalign.live.runs.fuzz.dp_ranks import machine_class as with_ranks

        return with_ranks(LiveFuzz, driver)
    if driver.opts.hicache:
        from kvalign.live.runs.fuzz.hicache_rules import machine_class as with_hicache

        return with_hicache(LiveFuzz, driver)
    return LiveFuzz


def run_fuzz(driver: FuzzDriver, *, examples: int, steps: int, seed: int | None, shrink_seconds: float,
             script_path: Path, report: Callable[[str], None]) -> FuzzResult:
    """Run the generated workloads; on a failure, shrink it and write its replay script."""
    import hypothesis.internal.conjecture.engine as engine
    from hypothesis.reporting import with_reporter

    cls = machine_class(driver)
    if seed is not None:
        cls._hypothesis_internal_use_seed = seed  # what hypothesis.seed() sets on a test
    failures: list[tuple[InvariantFailed, list[dict[str, Any]], list[dict[str, Any]]]] = []
    broken: list[FuzzEnvironmentError] = []  # the environment failed: every later step fails at once
    original_step, original_end = driver.run_step, driver.end_example

    def recorded(run: Callable[..., None]) -> Callable[..., None]:
        def call(*args: Any) -> None:
            if broken:
                raise broken[0]  # Hypothesis retries a failing example: never on a broken cluster
            try:
                run(*args)
            except InvariantFailed as exc:
                failures.append((exc, list(driver.steps), list(driver.observed)))
                raise
            except FuzzEnvironmentError as exc:
                broken.append(exc)
                raise
        return call

    driver.run_step, driver.end_example = recorded(original_step), recorded(original_end)  # type: ignore[method-assign]
    conf = settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                    derandomize=seed is None, phases=(Phase.generate, Phase.shrink), report_multiple_bugs=False,
                    suppress_health_check=list(HealthCheck), print_blob=False)
    start, saved = time.monotonic(), engine.MAX_SHRINKING_SECONDS
    engine.MAX_SHRINKING_SECONDS = int(shrink_seconds)  # Hypothesis's own bound on shrinking (300 s)
    result = FuzzResult(driver)
    try:
        with with_reporter(report):
            run_state_machine_as_test(cls, settings=conf)
    except Exception as exc:  # noqa: BLE001 - InvariantFailed, Flaky, or a broken environment seen by Hypothesis
        if broken and not failures:
            raise broken[0] from None
        if not failures:
            raise
        if isinstance(exc, InvariantFailed) and not broken:
            result.failure = _failure(driver, exc, failures, script_path)
        elif broken:  # the environment broke while shrinking: the failure already found stands, with its script
            result.failure = _failure(driver, failures[-1][0], failures, script_path,
                                      note=f"shrinking stopped: {str(broken[0]).splitlines()[0]}")
        else:  # Flaky: the failure did not reproduce on replay (a race, or a live state shrinking lost)
            result.failure = _failure(driver, failures[-1][0], failures, script_path, flaky=True,
                                      note=_flaky_note(failures[-1][0]))
    finally:
        engine.MAX_SHRINKING_SECONDS = saved
        driver.run_step, driver.end_example = original_step, original_end  # type: ignore[method-assign]
        result.seconds = time.monotonic() - start
    return result


def _failure(driver: FuzzDriver, exc: InvariantFailed, failures: list, script_path: Path, *,
             flaky: bool = False, note: str | None = None) -> Failure:
    """The failure to report: of every failure seen while generating and shrinking, the one of the
    first invariant in :data:`INVARIANTS` order (the user's own question before the model checks),
    with the fewest steps seen for it. Hypothesis shrinks towards *any* failure, and a blind router
    also fails ``best_worker_chosen`` on shorter workloads; the report must still say that the
    router credited 0 where the engine reused tokens."""
    exc, steps, observed = min(failures, key=lambda f: (INVARIANTS.index(f[0].invariant), len(f[1])))
    write_script(script_path, driver.opts, steps, exc, observed)
    return Failure.of(exc, str(script_path), flaky=flaky, note=note)


def _flaky_note(exc: InvariantFailed) -> str:
    """What a failure that the live replay did not reproduce is still known by: its cause, named from
    the stream recorded when it happened (:mod:`.recorded`), and the offline replay of that stream."""
    if exc.evidence and exc.evidence.get("replay"):
        return (f"replaying the steps live did not reproduce it (it depends on timing); the cause {exc.cause} is named "
                f"from the stream recorded when it failed: {exc.evidence['replay']}")
    return (f"replaying the steps live did not reproduce it (it depends on timing); the cause {exc.cause} was named "
            "from the captures at the time it failed (the run dir keeps them)")


def replay(driver: FuzzDriver, script: dict[str, Any], out_path: Path) -> FuzzResult:
    """Run a script's steps once, as one example, checking every invariant as the fuzz does;
    a failure is written to ``out_path`` (the replayed steps and what was seen this time)."""
    start = time.monotonic()
    result = FuzzResult(driver)
    driver.begin_example()
    try:
        for step in script["steps"]:
            driver.run_step(step)
        driver.end_example()
    except InvariantFailed as exc:
        write_script(out_path, driver.opts, list(driver.steps), exc, list(driver.observed))
        result.failure = Failure.of(exc, str(out_path))
    result.seconds = time.monotonic() - start
    return result


