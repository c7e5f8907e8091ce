"""Router replicas live: two real ``dynamo.frontend`` processes (each its own KV router) in front of
kvalign's fake CPU workers (SGLang's real radix cache and event publisher, Dynamo's real relay,
runtime and local indexer), on 127.0.0.1. Thin tests over :mod:`kvalign.live.runs.replica_scenario`.

* With replica sync, as Dynamo documents replicas, both routers would route every stored prompt to
  the worker holding it and take in every request's lifecycle events, through a restart of one
  router and an interruption of the event plane (each converged within the scenario's bound).
* Negative control, on the same cluster: the second router restarted without
  ``--router-replica-sync`` does not publish its requests' lifecycle events, so ``routers_agree``
  fails naming them, with both routers' numbers.
* The finding (Dynamo 1.6.1): in approximate mode (``--no-router-kv-events``) replica sync does not
  carry routing decisions, so a prompt one replica routed is unknown to the other.

One cluster for the module (about 20 s to start on two loaded cores): the approximate test restarts
both routers in approximate mode instead of starting a cluster of its own.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import cpu_stack_missing

from kvalign.live.cluster.lifecycle import Cluster, make_plan, with_routers
from kvalign.live.cluster.routers import RouterSetup
from kvalign.live.cluster.topology import CpuWorkerKind, Topology
from kvalign.live.runs.replica_check import LIFECYCLE_EVENTS_PER_REQUEST
from kvalign.live.runs.replica_scenario import ReplicaScenario

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BOUND_S = 30.0


@pytest.fixture(scope="module")
def replicas(module_run_dir) -> Iterator[Cluster]:
    """Two aggregated EAGLE fake workers behind two synced events-mode routers."""
    missing = cpu_stack_missing()
    if missing:
        pytest.skip(missing)
    plan = with_routers(make_plan(Topology.aggregated(2, eagle=True), module_run_dir), RouterSetup(2))
    with Cluster(plan, CpuWorkerKind(), startup_timeout_s=120.0) as cluster:
        yield cluster


def test_synced_replicas_agree_and_an_unsynced_restart_fails_routers_agree(replicas):
    cluster = replicas
    report = ReplicaScenario(cluster, bound_s=BOUND_S, progress=print).run(prompts=4)
    assert report.passed, report.render()
    stores = [s for s in report.steps if s.action == "store"]
    assert len(stores) == 5 and {s.router for s in stores} == {"router0", "router1"}, report.render()
    for s in stores:  # every replica named the holder of every stored prompt, and took in 3 events
        assert min(s.lifecycle.values()) >= LIFECYCLE_EVENTS_PER_REQUEST, report.render()
        assert all(len(names) == 1 for rs in s.choices.values() for names in rs.values()), report.render()
    faults = {s.action: s for s in report.steps if s.action in ("restart", "resume")}
    assert faults.keys() == {"restart", "resume"} and all(s.converge_s <= BOUND_S for s in faults.values())
    assert "Plost" in faults["resume"].choices  # the prompt stored while the event plane was down

    cluster.restart_router(1, routers=RouterSetup(2, unsynced=frozenset({1})))
    control = ReplicaScenario(cluster, bound_s=BOUND_S, progress=print).stores(2, seed=5000)
    assert not control.passed, control.render()
    failing = next(s for s in control.steps if s.failure)
    assert failing.router == "router1" and failing.lifecycle == {"router0": 0, "router1": 0}, control.render()
    assert "routers_agree" in control.render() and "routed by router1 publish 3" in control.failure


def test_approximate_replicas_do_not_share_routing_decisions(replicas):
    """Dynamo 1.6.1: ``--router-replica-sync`` syncs active sequences only; each approximate router
    predicts from its own routing decisions, so the other replica cannot tell where a prompt went
    (each replica would be held equal if sync carried them: this test pins the current behaviour)."""
    cluster, approx = replicas, RouterSetup(2, "approx")
    for replica in (0, 1):  # both routers in approximate mode, with replica sync; the workers stay
        cluster.restart_router(replica, routers=approx)
    report = ReplicaScenario(cluster, bound_s=BOUND_S, progress=print).stores(2, seed=9000)
    assert not report.passed, report.render()
    first = report.steps[0]
    assert first.router == "router0" and first.worker == "worker0"
    assert first.lifecycle == {"router0": 3, "router1": 3}, report.render()  # active sequences are synced
    choices: dict = {}
    for s in report.steps:  # each prompt's answers right after it was stored
        for p, rs in s.choices.items():
            choices.setdefault(p, rs)
    # the replica that routed each prompt names its worker; the other names both (a tie), at least once
    assert choices["P0"]["router0"] == ["worker0"] and choices["P1"]["router1"] == ["worker1"], report.render()
    assert ["worker0", "worker1"] in (choices["P0"]["router1"], choices["P1"]["router0"]), report.render()
