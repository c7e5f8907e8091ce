"""Fixtures for live e2e tests: shared and cold clusters, per-test logs, guaranteed teardown.

``shared_cluster(topology, kind)`` hands out the session's one cluster of that configuration
(:class:`kvalign.live.cluster.shared.SharedClusters`: keyed by engine, SGLang release, topology,
registration, control plane and the other knobs), health-checked and flushed — confirmed on the
engine's and the router's side — with a fresh KV-event capture in the test's run directory. A
test that needs a cold cluster (one it may close, or one whose start-up it asserts on) says so by
using ``live_cluster(topology, kind)``, which starts a cluster of its own and tears it down after
the test whatever happened (pass, fail, timeout, Ctrl-C). Shared clusters are stopped at the end
of the session, which then fails if any of their processes outlived them.

Each test's run directory — KV-event captures, and for a cold cluster its process logs and
discovery store — lives under ``$KVALIGN_E2E_OUT`` (default ``out/e2e``) / ``<test name>-<random>``;
it is deleted when the test passes and kept (its path printed in the report) when it fails, with
a copy of the shared cluster's process logs. A shared cluster's own directory
(``shared-<configuration>-<random>``) is kept when a test that used it failed or it was replaced.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvalign.live.cluster.lifecycle import Cluster, make_plan
from kvalign.live.cluster.shared import ClusterKey, SharedClusters
from kvalign.live.cluster.topology import CpuWorkerKind, Topology, WorkerKind

OUT_ROOT = Path(os.environ.get("KVALIGN_E2E_OUT", Path(__file__).resolve().parents[2] / "out" / "e2e"))

#: What the shared clusters did this session (starts, reuses, replacements, kept logs), printed in
#: the terminal summary: fixture teardown output is captured, the summary is not.
SHARED_LOG = pytest.StashKey[list[str]]()


def cpu_stack_missing() -> str | None:
    """Why the CPU live stack cannot run here (None when it can)."""
    from kvalign.oracles.base import OracleUnavailable
    from kvalign.oracles.dynamo import dynamo_version
    from kvalign.oracles.sglang import sglang_version

    try:
        dynamo_version()
        sglang_version()
    except OracleUnavailable as exc:
        return str(exc)
    for mod in ("dynamo.frontend", "dynamo.llm", "dynamo.runtime", "transformers"):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not importable: run scripts/setup.sh"
    return None


def sglang_cpu_missing(release: str | None = None) -> str | None:
    """Why the real SGLang engine (the environment's, or ``release`` from the wheel cache) cannot run
    on this CPU (None when it can)."""
    from kvalign.live.engines.sglang_cpu import engine_problem

    return cpu_stack_missing() or engine_problem(release)


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (a CI runner cancelling the job) unwinds like Ctrl-C, so every cluster fixture's
    teardown still runs; pytest finalises fixtures on KeyboardInterrupt."""
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--kvalign-router-eagle", choices=("on", "off"), default=None,
        help="GPU EAGLE e2e negative control: off = workers register enable_eagle=False, so the router "
             "hashes plain blocks (same as env KVALIGN_ROUTER_EAGLE=off, which works for any invocation)",
    )
    parser.addoption(
        "--kvalign-sglang", metavar="VERSION", default=None,
        help="real-engine CPU e2e tests: run the workers on this SGLang release, installed into kvalign "
             "matrix's wheel cache (default: the environment's)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts the real engine must be scheduled with the others that do
    (``tests/xdist_scopes.py``): beside them on the other worker, two real-engine clusters would
    share the two cores."""
    import xdist_scopes

    for item in items:
        wants = xdist_scopes.REAL_ENGINE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if wants and xdist_scopes.scope(item.nodeid) != xdist_scopes.REAL_ENGINE:
            raise pytest.UsageError(
                f"{item.nodeid} uses {', '.join(sorted(wants))} (the real SGLang engine) but is not scheduled "
                f"with the real-engine tests: name it test_real_engine_* or list its file in "
                f"tests/xdist_scopes.py's REAL_ENGINE_FILES")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    setattr(item, f"kvalign_report_{report.when}", report)
    return report


def _test_failed(node: pytest.Item) -> bool:
    """Whether ``node``'s set-up or call failed (read in a fixture's teardown)."""
    return any(getattr(getattr(node, f"kvalign_report_{w}", None), "failed", False) for w in ("setup", "call"))


@pytest.fixture
def live_run_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """This test's run directory; removed after a pass, kept (and reported) after a failure."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
    OUT_ROOT.mkdir(parents=True, exist_ok=True)
    # Unique per run: two pytest sessions in one checkout must never share (or delete) a run dir.
    path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=OUT_ROOT))
    yield path
    if _test_failed(request.node):
        request.node.add_report_section("teardown", "kvalign live logs", f"kept process logs under {path}/logs")
    else:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def module_run_dir(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A run directory shared by one test module (one cluster per module); kept when any test
    of the session failed meanwhile, removed otherwise."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name.rsplit("/", 1)[-1])
    OUT_ROOT.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=OUT_ROOT))
    failed_before = request.session.testsfailed
    yield path
    if request.session.testsfailed > failed_before:
        print(f"\nkvalign live logs kept under {path}")
    else:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def sglang_release(request: pytest.FixtureRequest) -> str | None:
    """``--kvalign-sglang``: the SGLang release the real-engine CPU tests run (None: the environment's)."""
    return request.config.getoption("--kvalign-sglang", default=None)


def install_release(version: str | None) -> None:
    """Install ``version`` into the wheel cache now (a fixture's set-up, not a test's timeout), or
    skip naming why it cannot be."""
    from kvalign.verify.report.matrix import MatrixError, ensure_release

    reason = sglang_cpu_missing(version)
    if reason:
        pytest.skip(reason)
    if version is not None:
        try:
            ensure_release("sglang", version)
        except MatrixError as exc:
            pytest.skip(f"sglang {version} cannot be installed into the wheel cache here: {exc}")


@pytest.fixture(scope="module")
def sglang_cpu_engine(sglang_release: str | None) -> None:
    """Skip (with the exact reason) where the real SGLang engine cannot run on this CPU."""
    install_release(sglang_release)


@pytest.fixture
def cpu_live_stack() -> None:
    """Skip (with the exact reason) where the CPU live stack is not installed."""
    reason = cpu_stack_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def shared_clusters(request: pytest.FixtureRequest) -> Iterator[SharedClusters]:
    """The session's shared clusters; at the end every one is stopped, and a process of any of
    them that outlived it fails the session's last test (at teardown)."""
    lines = request.config.stash.setdefault(SHARED_LOG, [])
    say = lines.append

    def run_dir_for(key: ClusterKey) -> Path:
        OUT_ROOT.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"shared-{key.slug}-", dir=OUT_ROOT))

    pool = SharedClusters(run_dir_for, log=say)
    yield pool
    leftovers = pool.close()
    for key, starts in pool.starts.items():
        say(f"{key.describe()}: started {starts}x, reused {pool.reuses.get(key, 0)}x")
    for run_dir in pool.run_dirs:
        if run_dir in pool.kept:
            say(f"logs kept under {run_dir}/logs")
        elif run_dir not in leftovers:
            shutil.rmtree(run_dir, ignore_errors=True)
    assert not leftovers, f"processes outlived their shared cluster: {leftovers}"


def _summary(config: pytest.Config) -> list[str]:
    return [f"kvalign shared clusters: {line}" for line in config.stash.get(SHARED_LOG, [])]


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its lines to the controller, which prints them (tests/conftest.py)."""
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:
        worker_output["kvalign_summary"] = _summary(session.config)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _summary(terminalreporter.config):
        terminalreporter.write_line(line)


@pytest.fixture
def shared_cluster(cpu_live_stack: None, shared_clusters: SharedClusters, live_run_dir: Path,
                   request: pytest.FixtureRequest) -> Iterator[Callable[..., Cluster]]:
    """Factory: ``shared_cluster(topology, kind=CpuWorkerKind(), **plan_kw)`` -> the session's
    cluster of that configuration, healthy and flushed, its capture fresh under this test's run
    directory. After a failed test the cluster's logs are copied into the run directory and the
    cluster is retired (the next user gets a fresh one: a failure never leaks into another test)."""
    used: list[Cluster] = []

    def get(topology: Topology, kind: WorkerKind | None = None, **plan_kw: object) -> Cluster:
        capture_dir = live_run_dir / f"cluster{len(used)}" / "captures"
        cluster = shared_clusters.get(topology, kind or CpuWorkerKind(), capture_dir, **plan_kw)
        used.append(cluster)
        return cluster

    yield get
    if _test_failed(request.node):
        for cluster in used:
            shutil.copytree(cluster.plan.run_dir / "logs", live_run_dir / "logs" / cluster.plan.run_dir.name,
                            dirs_exist_ok=True)
            shared_clusters.discard(cluster)


@pytest.fixture
def live_cluster(cpu_live_stack: None, live_run_dir: Path) -> Iterator[Callable[..., Cluster]]:
    """Factory for a cold cluster of the test's own: ``live_cluster(topology, kind=CpuWorkerKind(),
    **plan_kw)`` -> a ready cluster, stopped after the test. For tests that close the cluster or
    assert on its start-up; every other test takes ``shared_cluster``."""
    started: list[Cluster] = []

    def start(topology: Topology, kind: WorkerKind | None = None, *, startup_timeout_s: float = 90.0, **plan_kw: object) -> Cluster:
        run_dir = live_run_dir / f"cluster{len(started)}"
        cluster = Cluster(make_plan(topology, run_dir, **plan_kw), kind or CpuWorkerKind(),
                          startup_timeout_s=startup_timeout_s)
        started.append(cluster)
        return cluster.__enter__()

    try:
        yield start
    finally:
        for cluster in reversed(started):
            cluster.close()


@pytest.fixture(scope="module")
def shipped_release() -> str:
    """The SGLang the environment's Dynamo release pins (``ai-dynamo[sglang]``), installed into the
    wheel cache: 0.5.21 for the pinned Dynamo 1.6.1. Skips when it is the environment's own SGLang
    (the real-engine tests on the environment's SGLang cover it) or cannot be installed here."""
    from kvalign.verify.report.matrix import MatrixError, installed, shipped_sglang

    dynamo = installed("ai-dynamo")
    if dynamo is None:
        pytest.skip("ai-dynamo is not installed: run scripts/setup.sh")
    try:
        version = shipped_sglang(dynamo)
    except MatrixError as exc:
        pytest.skip(f"cannot read ai-dynamo {dynamo}'s shipped SGLang: {exc}")
    if version is None or version == installed("sglang"):
        pytest.skip(f"ai-dynamo {dynamo} ships sglang {version}, the environment's own: the real-engine tests "
                    "on the environment's SGLang cover it")
    install_release(version)
    return version
