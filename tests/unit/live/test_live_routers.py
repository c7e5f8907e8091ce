"""Router replicas in a plan: the flags each frontend gets, and a port of its own on loopback."""

from __future__ import annotations

import pytest

from kvalign.live.cluster.lifecycle import make_plan, plan_specs, with_routers
from kvalign.live.cluster.routers import RouterSetup, frontend_process_name
from kvalign.live.cluster.topology import CpuWorkerKind, Topology


def test_one_router_is_the_plain_frontend():
    setup = RouterSetup()
    assert setup.flags(0) == [] and not setup.replicated and setup.describe() == "1 router (events)"


def test_replicas_sync_as_dynamo_documents_them_except_the_unsynced_control():
    setup = RouterSetup(2)
    assert setup.flags(0) == setup.flags(1) == ["--router-replica-sync"]
    control = RouterSetup(2, unsynced=frozenset({1}))
    assert control.flags(0) == ["--router-replica-sync"] and control.flags(1) == []
    assert control.describe() == "2 routers (events, replica sync; router1 unsynced)"


def test_approx_mode_flags():
    assert RouterSetup(mode="approx").flags(0) == ["--no-router-kv-events", "--router-approximate-cache-policy", "ttl"]
    assert RouterSetup(mode="approx", approx_policy="lru", ttl_secs=5).flags(0)[-2:] == ["--router-ttl-secs", "5"]


@pytest.mark.parametrize("kwargs, message", [
    ({"count": 0}, "--routers must be >= 1"), ({"mode": "guess"}, "--router-mode"),
    ({"approx_policy": "fifo"}, "--approx-policy"), ({"ttl_secs": 0}, "--router-ttl"),
    ({"count": 2, "unsynced": frozenset({2})}, "not among the 2 routers"),
])
def test_bad_setups_are_refused_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RouterSetup(**kwargs)


def test_with_routers_gives_each_replica_its_own_loopback_port(tmp_path):
    plan = with_routers(make_plan(Topology.aggregated(2, eagle=True), tmp_path), RouterSetup(3))
    ports = plan.all_ports()
    assert len(ports) == len(set(ports)) and len(plan.router_http_ports) == 2
    assert plan.frontend_urls == [f"http://127.0.0.1:{p}" for p in (plan.http_port, *plan.router_http_ports)]
    fronts = [s for s in plan_specs(plan, CpuWorkerKind()) if s.name.startswith("frontend")]
    assert [s.name for s in fronts] == [frontend_process_name(i) for i in range(3)] == ["frontend", "frontend1", "frontend2"]
    for spec, port in zip(fronts, (plan.http_port, *plan.router_http_ports)):
        argv = spec.argv
        assert argv[argv.index("--http-port") + 1] == str(port) and argv[argv.index("--http-host") + 1] == "127.0.0.1"
        assert argv[-1] == "--router-replica-sync"
