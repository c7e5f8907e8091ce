"""Shared test set-up: Hypothesis profiles and a count of generated cases.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (derandomized, no deadline; the default when ``CI`` is
set), ``dev`` (random, no deadline; the default otherwise), ``nightly`` (10x examples) and
``fast`` (20 examples; the default of the fast tier, ``-m "not slow and not e2e"``).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time

# Bytecode is written, whatever PYTHONDONTWRITEBYTECODE says: with it set (as on the developers'
# machines and CI's), every xdist worker and every process a test starts (a CLI, a worker) compiled
# kvalign from source and pytest re-rewrote every test module: about 10 s of the fast tier's 67 s
# (56.9 s with the caches). __pycache__ is gitignored; Python rewrites a stale one itself.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Dynamo's Rust core sets up logging when first imported; keep its INFO/WARN lines out of test
# output (skipped stores are expected under the misaligned negative controls).
os.environ.setdefault("DYN_LOG", "error")

# A shell without job control starts background commands with SIGINT ignored, and an ignored
# signal stays ignored across exec: run that way (`.ci/run &`, a CI runner's detached step), every
# CLI the tests start would ignore the ctrl-c the tests send it and time out. Python's own handler
# is reset to the default at exec, so children get the ctrl-c a terminal would give them. SIGQUIT is
# ignored the same way: a process the tests start would begin with it ignored, and a fork server forked
# from it before SGLang sets its handler kept that (test_sglang_cpu_forkserver.py's control, run so).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGQUIT) is signal.SIG_IGN:
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_BASE = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True)
settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **_BASE)
settings.register_profile("dev", max_examples=100, **_BASE)
settings.register_profile("nightly", max_examples=1000, **_BASE)
settings.register_profile("fast", max_examples=20, **_BASE)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-json", metavar="PATH", default=None,
                     help="write every test's set-up/call/teardown seconds, outcome and markers to PATH "
                          "(read by bench/suite_times.py)")


def pytest_configure(config: pytest.Config) -> None:
    """The fast tier (``-m "not slow ..."``) runs 20 examples per property test unless a profile is chosen.

    Negative controls search with their own fixed budgets (``run_search(..., n)``), so they are
    as strong in the fast tier as in the full suite.
    """
    if not os.environ.get("HYPOTHESIS_PROFILE") and "not slow" in (config.option.markexpr or ""):
        settings.load_profile("fast")
    if _fast_tier(config):
        # One OpenMP thread for torch in this process and what it starts: with four workers on two cores,
        # torch's second thread spin-waits for CPU another worker needs (test_e2e_plan.py and
        # test_engine_model_kv_pair.py -n 0: 17.9 -> 12.6 s CPU). Set before any test module imports torch.
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    global _DURATIONS_ON
    _DURATIONS_ON = bool(config.getoption("durations_json"))
    if config.pluginmanager.hasplugin("xdist") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(XdistTotals(), "kvalign-xdist-totals")
    if hasattr(config, "workerinput"):
        atexit.register(_skip_finalization)


def _skip_finalization() -> None:
    """End an xdist worker without tearing its interpreter down.

    Registered before the test modules import torch, SGLang and Dynamo, so their own exit handlers
    (publisher shutdowns, the runtime's bridge tasks) still run first; what is skipped is the module
    teardown after them: about 1.7 s of CPU per worker that imported SGLang, and all the workers of a
    run tear down at once, when the last one finishes. Every result has reached the controller by
    then. ``bench/bench_fast_tier.py --against REF`` measures it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class CaseCounter:
    """Counts examples run by property tests, so CI can show it ran the volume it claims."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


_COUNTER = CaseCounter()


@pytest.fixture(scope="session")
def count_case() -> CaseCounter:
    """Call once per generated example in a property test."""
    return _COUNTER


_DURATIONS: dict[str, dict] = {}
_STARTED: dict[str, tuple[int, float]] = {}  # nodeid -> (cases, CPU seconds) when its set-up began
_IGNORED_MARKS = ("parametrize", "timeout", "usefixtures", "skipif", "xfail", "filterwarnings", "xdist_group")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _STARTED[item.nodeid] = (_COUNTER.n, _cpu_seconds())
    from gpu_skip import gpus_needed, skip_reason

    needed = gpus_needed(item)
    if needed and (why := skip_reason(needed)):
        pytest.skip(why)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """Cases, CPU and markers ride on the teardown report's ``user_properties``: measured in the
    process that ran the test (an xdist worker too), read wherever the report is logged."""
    report = yield
    if report.skipped:
        from gpu_skip import fail_if_required, gpus_needed

        fail_if_required(report, gpus_needed(item))
    if report.when == "teardown" and item.nodeid in _STARTED:
        cases, cpu = _STARTED.pop(item.nodeid)
        marks = sorted({m.name for m in item.iter_markers() if m.name not in _IGNORED_MARKS})
        report.user_properties.append(("kvalign", {"cases": _COUNTER.n - cases, "markers": marks,
                                                   "cpu": round(_cpu_seconds() - cpu, 3),
                                                   "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                                                   "ended": round(time.time(), 2)}))
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not _DURATIONS_ON:
        return
    row = _DURATIONS.setdefault(report.nodeid, {})
    row[report.when] = round(report.duration, 4)
    if report.when == "call" or report.outcome != "passed":
        row["outcome"] = "skipped" if report.skipped else report.outcome
    row.update(next((v for k, v in report.user_properties if k == "kvalign"), {}))


_DURATIONS_ON = False
#: xdist workers for ``-n auto`` (pyproject's default). The fast tier waits as well as computes
#: (runtimes starting, subscriptions joining, children stopping, timeouts a negative control sits
#: out), so more workers than cores overlap the waits; but it is CPU-bound on two cores, and each worker
#: collects the tier (about 4 CPU-s) and imports what its tests need. Three, two of them taking the files
#: that import SGLang (``xdist_scopes.SGLANG_WORKERS``): 134 CPU-s against 158 with four (the same tree, one
#: pair side by side, cgroup, load 8-13; docs/development.md, issue 45's fifth pass). A run with live tests keeps two: the
#: real-engine cluster takes a core or more, and more workers beside it only slow it.
FAST_TIER_WORKERS, SUITE_WORKERS = 3, 2


def _fast_tier(config: pytest.Config) -> bool:
    expr = config.option.markexpr or ""
    return "not slow" in expr and "not e2e" in expr


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    """The fast tier does not import what it would deselect as a whole (:func:`xdist_scopes.deselected_as_a_whole`)."""
    import xdist_scopes

    if _fast_tier(config) and xdist_scopes.deselected_as_a_whole(collection_path):
        return True
    return None


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return FAST_TIER_WORKERS if _fast_tier(config) else SUITE_WORKERS


_WORKER_CASES: list[int] = []  # generated cases each finished xdist worker reported
_WORKER_SUMMARY: list[str] = []  # summary lines a worker's conftest left (tests/e2e: the shared clusters)


class XdistTotals:
    """Under pytest-xdist each worker counts its own cases; the controller adds them up. And it
    schedules by :func:`xdist_scopes.scope`: a test file runs on one worker (its module fixtures
    are set up once), the real-engine live tests on one worker, the fake-worker live tests on one
    worker. The live scopes go out first, longest first: the real engine's is the longest unit by
    far, and xdist's own order (most tests first) could hand it out after a minute of unit files,
    which the whole run would then wait for. Only the first ``xdist_scopes.SGLANG_WORKERS`` workers to ask
    take the files that import SGLang (:func:`xdist_scopes.next_scope`): the others never pay its import.
    (xdist's ``loadgroup`` would say this with markers, but
    it renames node ids through an attribute pytest 9 no longer reads, so its groups are lost.)"""

    @pytest.hookimpl
    def pytest_xdist_make_scheduler(self, config: pytest.Config, log: object) -> object:
        import xdist_scopes
        from xdist.scheduler import LoadScopeScheduling

        class FilesAndLive(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return xdist_scopes.scope(nodeid)

            def __init__(self, config: pytest.Config, log: object) -> None:
                super().__init__(config, log)
                self.sglang_nodes: list[object] = []  # the workers that may import SGLang

            def _assign_work_unit(self, node: object) -> None:
                for live in reversed(xdist_scopes.LIVE_SCOPES):
                    if live in self.workqueue:
                        self.workqueue.move_to_end(live, last=False)
                if node not in self.sglang_nodes and len(self.sglang_nodes) < xdist_scopes.SGLANG_WORKERS:
                    self.sglang_nodes.append(node)
                scope = xdist_scopes.next_scope(list(self.workqueue), node in self.sglang_nodes)
                if scope is None:
                    node.shutdown()
                    return
                self.workqueue.move_to_end(scope, last=False)
                super()._assign_work_unit(node)

        return FilesAndLive(config, log)

    @pytest.hookimpl
    def pytest_testnodedown(self, node: object, error: object) -> None:
        output = getattr(node, "workeroutput", {})
        _WORKER_CASES.append(output.get("kvalign_cases", 0))
        _WORKER_SUMMARY.extend(output.get("kvalign_summary", []))


def _cases() -> int:
    return _COUNTER.n + sum(_WORKER_CASES)


def pytest_sessionfinish(session: pytest.Session) -> None:
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:
        worker_output["kvalign_cases"] = _COUNTER.n


def _cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children: unlike wall time, barely moved by other
    work on a shared machine."""
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def _write_durations(config: pytest.Config) -> None:
    import json

    path = config.getoption("durations_json")
    if not path:
        return
    start = getattr(config, "_kvalign_session_start", None)
    doc = {"markexpr": config.option.markexpr or "", "args": list(config.invocation_params.args),
           "session_s": round(time.monotonic() - start, 2) if start else None,
           "generated_cases": _cases(), "ended": round(time.time(), 2), "tests": _DURATIONS}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._kvalign_session_start = time.monotonic()  # noqa: SLF001 - for --durations-json


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if hasattr(terminalreporter.config, "workerinput"):
        return
    for line in _WORKER_SUMMARY:
        terminalreporter.write_line(line)
    _write_durations(terminalreporter.config)
    profile = settings._current_profile  # noqa: SLF001 - only for the summary line
    terminalreporter.write_line(f"hypothesis profile {profile}: {_cases()} generated property cases executed")
