"""Live router decisions on CPU: real Dynamo frontend + KV router, workers keyed by SGLang's
real radix cache (``kvalign.live.engines.fake_cpu_worker``), real processes and sockets on 127.0.0.1.

Thin per-topology tests over the shared scenario and checks in :mod:`kvalign.live.runs.scenario`;
the GPU nightly runs the same scenario with ``dynamo.sglang`` workers. Each configuration's
cluster is started once per session and flushed between tests (``shared_cluster``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvalign.model.causes import Cause
from kvalign.model.events import AllBlocksCleared
from kvalign.live.runs import scenario
from kvalign.live.cluster.processes import group_alive, pids_with_env
from kvalign.live.cluster.shared import ClusterKey, SharedClusters
from kvalign.live.cluster.topology import RUN_MARKER_ENV, CpuWorkerKind, Topology
from kvalign.live.wire.client import stream_chat

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _listening_ports(pids: list[int]) -> list[str]:
    """``ss -ltnp`` lines owned by ``pids`` (empty when ss is missing)."""
    try:
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]


def _assert_aligned(cluster, records) -> None:
    scenario.check_timing(records)
    scenario.check_prompt_tokens(records)
    scenario.check_same_worker(records)
    scenario.check_hit_positive(records)
    scenario.check_prediction(records, tolerance_blocks=1)
    assert not cluster.capture.errors, f"undecodable KV-event frames: {cluster.capture.errors[:3]}"


@pytest.mark.parametrize("eagle", [True, False], ids=["eagle", "plain"])
def test_prefix_requests_stick_to_one_worker_with_predicted_hit_rate(shared_cluster, eagle):
    cluster = shared_cluster(Topology.aggregated(2, eagle=eagle))
    assert all(h.enable_eagle is eagle for h in cluster.workers.values()), "registered enable_eagle != engine mode"
    pids = cluster.group.pids()
    listening = _listening_ports(pids)
    assert listening, "ss found no listening socket of the cluster (is iproute2 installed?)"
    assert all(" 127.0.0.1:" in line for line in listening), "a socket listens beyond loopback:\n" + "\n".join(listening)

    records = scenario.run_prefix_extension(cluster, 4)
    print(scenario.table(records))
    _assert_aligned(cluster, records)
    assert all(r.router_eagle is eagle for r in records)
    d = scenario.diagnose(cluster, records[1])
    assert d.cause is None and d.report.router["overlap"] == d.report.engine["overlap"] == d.report.router["blocks"] > 0, d.line()


def test_negative_control_bigram_cache_registered_without_eagle_is_cache_blind(shared_cluster):
    cluster = shared_cluster(Topology.aggregated(2, eagle=True, register_eagle=False))
    assert not any(h.enable_eagle for h in cluster.workers.values())

    records = scenario.run_prefix_extension(cluster, 4)
    print(scenario.table(records))
    scenario.check_timing(records)
    scenario.check_hit_zero(records)
    scenario.check_prediction(records, tolerance_blocks=0)  # kvalign also predicts 0: same flags, same miss
    with pytest.raises(AssertionError, match="kv_hit_rate not > 0"):
        scenario.check_hit_positive(records)
    for r in records[1:]:
        d = scenario.diagnose(cluster, r)
        print(f"request {r.index + 1}: {d.line()}")
        assert d.cause is Cause.ROUTER_EAGLE_OFF, d.line()
        rep = d.report
        assert rep.first_divergent == 0 and rep.router["eagle"] is False and rep.engine["eagle"] is True
        assert rep.router["overlap"] == 0 and rep.engine["overlap"] >= 1  # the cache the router could not see
    cli = subprocess.run([sys.executable, "-m", "kvalign", *scenario.diagnose(cluster, records[1]).cli_args],
                         capture_output=True, text=True, timeout=60)
    print(cli.stdout)
    assert cli.returncode == 1, cli.stderr
    assert f"cause: {Cause.ROUTER_EAGLE_OFF.value}" in cli.stdout


@pytest.mark.parametrize("bootstrap_endpoint", [True, False], ids=["bootstrap-endpoint", "prefill-returns-params"])
def test_disaggregated_prefill_routing(shared_cluster, bootstrap_endpoint):
    cluster = shared_cluster(Topology.disaggregated(2, 1, eagle=True), CpuWorkerKind(bootstrap_endpoint=bootstrap_endpoint))
    records = scenario.run_prefix_extension(cluster, 4)
    print(scenario.table(records))
    _assert_aligned(cluster, records)
    scenario.check_not_decode(records, cluster.ids_by_role("decode"))
    assert scenario.check_same_worker(records) in cluster.ids_by_role("prefill")
    for r in records:
        assert r.result.timing.get("kv_transfer_estimated_latency_ms", 0) >= 0


def test_teardown_leaves_no_process_behind(live_cluster):
    """Cold: it closes its cluster, so it starts one of its own (``live_cluster``), never a shared one."""
    cluster = live_cluster(Topology.aggregated(1, eagle=True))
    pids = cluster.group.pids()
    marked = pids_with_env(RUN_MARKER_ENV, str(cluster.plan.run_dir))
    assert sorted(marked) == sorted(pids), "the run marker does not find exactly the cluster's processes"
    cluster.close()
    assert not [p for p in pids if group_alive(p)], "process groups survived teardown"
    assert not pids_with_env(RUN_MARKER_ENV, str(cluster.plan.run_dir)), "a process of the run survived"
    assert cluster.group.killed == [], f"needed SIGKILL (no graceful exit on SIGTERM): {cluster.group.killed}"
    cluster.close()  # idempotent


@pytest.mark.timeout(360)
def test_a_shared_cluster_is_flushed_for_each_user_and_replaced_after_a_crash(cpu_live_stack, live_run_dir):
    """Cold: a pool of its own, so the crash it causes and the restart it checks touch no other test's
    cluster (its 1-worker configuration is started twice on purpose)."""
    pool = SharedClusters(lambda key: Path(tempfile.mkdtemp(prefix=f"{key.slug}-", dir=live_run_dir)))
    topology, kind = Topology.aggregated(1, eagle=True), CpuWorkerKind()
    key = ClusterKey.of(topology, kind)
    content = scenario.prefix_prompts(3)[2]
    try:
        cluster = pool.get(topology, kind, live_run_dir / "user1")
        stream_chat(cluster.frontend_url, cluster.model, content)
        cluster.capture.wait_for(lambda snap: len(snap) >= 2, 5.0)  # the flush's AllBlocksCleared, then the store
        time.sleep(1.0)  # the router indexes the same events (the scenario's pause)
        assert (stream_chat(cluster.frontend_url, cluster.model, content).kv_hit_rate or 0) > 0

        assert pool.get(topology, kind, live_run_dir / "user2") is cluster and pool.starts == {key: 1}
        first = cluster.capture.snapshot()[0].batch.events[0]
        assert isinstance(first, AllBlocksCleared), "the next user's capture does not start at the flush"
        assert stream_chat(cluster.frontend_url, cluster.model, content).kv_hit_rate == 0.0, "the router kept a flushed prefix"

        worker = next(p for p in cluster.group.procs if p.spec.name == "worker0")
        os.killpg(worker.pid, signal.SIGKILL)
        fresh = pool.get(topology, kind, live_run_dir / "user3")
        assert fresh is not cluster and pool.starts == {key: 2} and cluster.plan.run_dir in pool.kept
        assert stream_chat(fresh.frontend_url, fresh.model, content).kv_hit_rate == 0.0
    finally:
        leftovers = pool.close()
    assert leftovers == {}, f"processes outlived their shared cluster: {leftovers}"
