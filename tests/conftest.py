"""Shared test set-up: Hypothesis profiles and a count of generated cases.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (derandomized, no deadline; the default when ``CI`` is
set), ``dev`` (random, no deadline; the default otherwise), ``nightly`` (10x examples) and
``fast`` (20 examples; the default of the fast tier, ``-m "not slow and not e2e"``).
"""

from __future__ import annotations

import os
import time

# Dynamo's Rust core sets up logging when first imported; keep its INFO/WARN lines out of test
# output (skipped stores are expected under the misaligned negative controls).
os.environ.setdefault("DYN_LOG", "error")

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


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _record_start(item)
    from gpu_skip import gpus_needed, skip_reason

    needed = gpus_needed(item)
    if needed and (why := skip_reason(needed)):
        pytest.skip(why)


def _record_start(item: pytest.Item) -> None:
    if item.config.getoption("durations_json"):
        _DURATIONS.setdefault(item.nodeid, {"markers": sorted({m.name for m in item.iter_markers()
                                                              if m.name not in ("parametrize", "timeout", "usefixtures",
                                                                                "skipif", "xfail", "filterwarnings")}),
                                                 "_cases_before": _COUNTER.n, "_cpu_before": _cpu_seconds()})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.nodeid in _DURATIONS:
        row = _DURATIONS[report.nodeid]
        row[report.when] = round(report.duration, 4)
        if report.when == "call" or report.outcome != "passed":
            row["outcome"] = "skipped" if report.skipped else report.outcome
        if report.when == "teardown" and "_cases_before" in row:
            row["cases"] = _COUNTER.n - row.pop("_cases_before")
            row["cpu"] = round(_cpu_seconds() - row.pop("_cpu_before"), 3)


def _cpu_seconds() -> float:
    """CPU seconds of this process and its reaped children: unlike wall time, barely moved by other
    work on a shared machine."""
    import resource

    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def _write_durations(config: pytest.Config) -> None:
    import json
    import time

    path = config.getoption("durations_json")
    if not path:
        return
    start = getattr(config, "_kvalign_session_start", None)
    doc = {"markexpr": config.option.markexpr or "", "args": list(config.invocation_params.args),
           "session_s": round(time.monotonic() - start, 2) if start else None,
           "generated_cases": _COUNTER.n, "tests": _DURATIONS}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)


def pytest_sessionstart(session: pytest.Session) -> None:
    import time

    session.config._kvalign_session_start = time.monotonic()  # noqa: SLF001 - for --durations-json


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    _write_durations(terminalreporter.config)
    profile = settings._current_profile  # noqa: SLF001 - only for the summary line
    terminalreporter.write_line(f"hypothesis profile {profile}: {_COUNTER.n} generated property cases executed")
