"""The live harness over Dynamo's etcd + NATS control plane (``--control-plane etcd-nats``).

Same CPU prefix-extension scenario and checks as the file-discovery test in
``test_router_cpu.py`` (EAGLE, 2 aggregated workers), but discovery goes through a real ``etcd``
and KV events through a real ``nats-server``, both on loopback ports and torn down with the run.
Skips only when those binaries are absent (scripts/setup.sh installs them).
"""

from __future__ import annotations

import subprocess

import pytest

from kvalign.live.cluster import discovery
from kvalign.live.runs import scenario
from kvalign.live.cluster.processes import group_alive, pids_with_env
from kvalign.live.cluster.topology import RUN_MARKER_ENV, Topology, control_plane_missing

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


@pytest.fixture
def etcd_nats() -> None:
    reason = control_plane_missing("etcd-nats")
    if reason:
        pytest.skip(reason)


def _listening(pids: list[int]) -> list[str]:
    """``ss -ltnp`` lines owned by ``pids``."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    return [line for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]


def test_prefix_requests_over_etcd_and_nats(etcd_nats, live_cluster):
    cluster = live_cluster(Topology.aggregated(2, eagle=True), control_plane="etcd-nats")
    plan = cluster.plan
    names = [p.spec.name for p in cluster.group.procs]
    assert names[:2] == ["etcd", "nats"] and "broker" not in names
    assert all(p.spec.infrastructure for p in cluster.group.procs[:2])
    assert all(h.enable_eagle for h in cluster.workers.values()), "registered enable_eagle != engine mode"

    # Discovery went through etcd: the file store was never written, and etcd holds every worker.
    assert not plan.file_kv.exists()
    in_etcd = {i.instance_id for i in discovery.instances(discovery.EtcdStore(plan.etcd_url))}
    assert {h.instance_id for h in cluster.workers.values()} <= in_etcd

    pids = cluster.group.pids()
    listening = _listening(pids)
    for port in (plan.etcd_client, plan.etcd_peer, plan.nats_port):
        assert any(f" 127.0.0.1:{port} " in line for line in listening), f"nothing listens on 127.0.0.1:{port}"
    assert all(" 127.0.0.1:" in line for line in listening), "a socket listens beyond loopback:\n" + "\n".join(listening)

    records = scenario.run_prefix_extension(cluster, 4)
    print(scenario.table(records))
    scenario.check_timing(records)
    scenario.check_prompt_tokens(records)
    worker = scenario.check_same_worker(records)
    scenario.check_hit_positive(records)  # the router's index was fed over NATS
    scenario.check_prediction(records, tolerance_blocks=1)
    assert not cluster.capture.errors, f"undecodable KV-event frames: {cluster.capture.errors[:3]}"
    assert worker in in_etcd and all(r.router_eagle for r in records)
    d = scenario.diagnose(cluster, records[1])
    assert d.cause is None and d.report.router["overlap"] == d.report.engine["overlap"] == d.report.router["blocks"] > 0, d.line()

    cluster.close()
    assert not [p for p in pids if group_alive(p)], "process groups (etcd/nats included) survived teardown"
    assert not pids_with_env(RUN_MARKER_ENV, str(plan.run_dir)), "a process of the run survived"
    assert cluster.group.killed == [], f"needed SIGKILL (no graceful exit on SIGTERM): {cluster.group.killed}"
