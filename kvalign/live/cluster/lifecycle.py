"""Launch a live topology (broker, workers, frontend), wait until it serves, always tear down.

Usage (the same for CPU tests, ``kvalign live up`` and the GPU nightly)::

    plan = make_plan(Topology.aggregated(2, eagle=True), run_dir, model_path)
    with Cluster(plan, CpuWorkerKind()) as cluster:   # ready when the block is entered
        cluster.frontend_url, cluster.workers["worker0"].instance_id, cluster.capture

Start order: the control plane's own processes (the event-plane broker; or etcd and nats-server
with ``control_plane="etcd-nats"``, each waited for until it serves), then workers, then (once
every worker is registered in discovery) the KV event capture and the frontend, then readiness = ``/v1/models`` lists the model and one tiny
request returns 200. Any process dying during startup fails at once with its log tail. On exit —
success, exception, timeout or Ctrl-C — every process group is stopped; ``keep_logs`` decides
whether the run directory (logs, discovery store, captures) survives. The control-plane
processes are stopped last, after every Dynamo process (they are ``infrastructure``).
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvalign.live.cluster import discovery
from kvalign.live.wire.capture import EventCapture
from kvalign.live.wire.client import wait_ready
from kvalign.releases.release_env import python_for
from kvalign.live.cluster import ranks
from kvalign.live.cluster.model_dir import MODEL_NAME, write_model_dir
from kvalign.live.cluster.discovery import EtcdStore
from kvalign.live.cluster.ports import LOOPBACK, PortPool
from kvalign.live.cluster.processes import ProcessGroup, ProcessSpec
from kvalign.live.cluster.routers import RouterSetup, frontend_process_name
from kvalign.live.cluster.topology import ClusterPlan, ControlPlane, Topology, WorkerKind, WorkerPorts, WorkerSpec


def make_plan(
    topology: Topology, run_dir: str | Path, model_path: str | Path | None = None, *,
    model_name: str | None = None, namespace: str | None = None, control_plane: ControlPlane = "file",
    dynamo_dir: Path | None = None, dynamo_version: str | None = None,
) -> ClusterPlan:
    """Allocate ports and names for ``topology``; builds the tiny model dir if no model is given.

    ``control_plane``: ``"file"`` (no service) or ``"etcd-nats"`` (etcd + nats-server processes).
    ``dynamo_dir``: another Dynamo release's directory (``kvalign matrix``'s wheel cache) that every
    process runs, ``dynamo_version`` its version: every process is started by the interpreter of that
    release's own environment (:func:`kvalign.releases.release_env.python_for`).
    """
    run = Path(run_dir).resolve()
    run.mkdir(parents=True, exist_ok=True)
    if model_path is None:
        model_path = write_model_dir(run / "model")
        model_name = model_name or MODEL_NAME
    pool = PortPool()
    if control_plane == "etcd-nats":
        control = {name: pool.take(name.replace("_", ".")) for name in ("etcd_client", "etcd_peer", "nats_port")}
    else:
        control = {"broker_xsub": pool.take("broker.xsub"), "broker_xpub": pool.take("broker.xpub")}
    plan = ClusterPlan(
        topology=topology, namespace=namespace or f"kvalign-{uuid.uuid4().hex[:10]}",
        model_path=str(model_path), model_name=model_name or Path(model_path).name, run_dir=run,
        http_port=pool.take("frontend.http"), control_plane=control_plane, dynamo_dir=dynamo_dir,
        dynamo_version=dynamo_version, python=python_for([dynamo_dir]) if dynamo_dir else sys.executable, **control,
    )
    for w in topology.workers:
        plan.worker_ports[w.name] = WorkerPorts.allocate(pool, w.name, kv_ranks=topology.dp_size if w.role == "agg" else 1)
    return plan


def with_routers(plan: ClusterPlan, setup: RouterSetup) -> ClusterPlan:
    """``plan`` with ``setup``'s routers (:mod:`kvalign.live.cluster.routers`): one more loopback HTTP
    port per extra frontend replica, clear of every port the plan already uses."""
    pool = PortPool()
    pool.assigned.update({f"plan.{i}": p for i, p in enumerate(plan.all_ports())})
    extra = tuple(pool.take(f"{frontend_process_name(i)}.http") for i in range(1, setup.count))
    return dataclasses.replace(plan, routers=setup, router_http_ports=extra)


def plan_specs(plan: ClusterPlan, kind: WorkerKind) -> list[ProcessSpec]:
    """Every process of the plan in start order (a dry run prints these)."""
    return [*plan.infrastructure_specs(), *kind.support_specs(plan), *(kind.command(w, plan) for w in plan.topology.workers),
            *plan.frontend_specs()]


def nats_ready(port: int, host: str = LOOPBACK, timeout_s: float = 1.0) -> bool:
    """A NATS server greets every client with an ``INFO {...}`` line as soon as it serves."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            return s.recv(5) == b"INFO "
    except OSError:
        return False


@dataclass
class WorkerHandle:
    """A started worker and what discovery says about it."""

    spec: WorkerSpec
    ports: WorkerPorts
    instance_id: int
    enable_eagle: bool  # as registered in its model card: what the router hashes queries with
    kv_events_endpoint: str | None


class Cluster:
    """A running topology; use as a context manager (teardown is unconditional)."""

    def __init__(self, plan: ClusterPlan, kind: WorkerKind, *, startup_timeout_s: float = 120.0, keep_logs: bool = True,
                 router_view: Mapping[str, str] | None = None, engine_view: Mapping[str, str] | None = None):
        """``router_view``: per worker, the endpoint Dynamo's relay reads (a lossy hop); when given,
        :attr:`router_capture` records it beside :attr:`capture`, which reads SGLang directly, or
        ``engine_view`` (the hop's unaltered copy of SGLang's stream) when that is given."""
        self.plan, self.kind = plan, kind
        self.startup_timeout_s = startup_timeout_s
        self.keep_logs = keep_logs
        self.group = ProcessGroup(plan.run_dir / "logs")
        self.workers: dict[str, WorkerHandle] = {}
        self.capture: EventCapture | None = None
        self.router_view = dict(router_view) if router_view is not None else None
        self.engine_view = dict(engine_view) if engine_view is not None else None
        self.router_capture: EventCapture | None = None
        self.ready_s: float | None = None

    @property
    def frontend_url(self) -> str:
        return self.plan.frontend_url

    @property
    def model(self) -> str:
        return self.plan.model_name

    def ids_by_role(self, role: str) -> set[int]:
        return {w.instance_id for w in self.workers.values() if w.spec.role == role}

    def __enter__(self) -> "Cluster":
        try:
            self._start()
        except BaseException:
            self.close(failed=True)
            raise
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close(failed=exc_type is not None)

    def _start(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        for spec in self.plan.infrastructure_specs():
            self.group.start(spec)
        if self.plan.control_plane == "etcd-nats":
            self._await_control_plane(deadline)
        for spec in self.kind.support_specs(self.plan):
            self.group.start(spec)
        for w in self.plan.topology.workers:
            self.group.start(self.kind.command(w, self.plan))
        for w in self.plan.topology.workers:
            self.workers[w.name] = self._await_registration(w, deadline)
        endpoints = self.engine_view if self.engine_view is not None else ranks.endpoints(self.plan)
        self.capture = EventCapture(endpoints, capture_dir=self.plan.run_dir / "captures")
        if self.router_view is not None:
            self.router_capture = EventCapture(self.router_view, capture_dir=self.plan.run_dir / "captures" / "router")
        for spec in self.plan.frontend_specs():
            self.group.start(spec)
        self.ready_s = sum(wait_ready(url, self.model, timeout_s=max(1.0, deadline - time.monotonic()),
                                      alive=self.group.check_alive) for url in self.plan.frontend_urls)

    def _await_control_plane(self, deadline: float) -> None:
        """Dynamo retries etcd/NATS at start-up, but a worker that outlives its retry budget dies
        with a confusing error; waiting here names the service that did not come up."""
        etcd = EtcdStore(self.plan.etcd_url)
        pending = {"etcd": etcd.healthy, "nats": lambda: nats_ready(self.plan.nats_port)}
        while pending and time.monotonic() < deadline:
            self.group.check_alive()
            pending = {name: probe for name, probe in pending.items() if not probe()}
            if pending:
                time.sleep(0.1)
        if pending:
            raise TimeoutError(f"{' and '.join(pending)} did not serve within {self.startup_timeout_s:.0f}s "
                               f"(logs: {self.group.log_dir})")

    def restart_worker(self, name: str, timeout_s: float | None = None, *,
                       env: Mapping[str, str] | None = None) -> WorkerHandle:
        """Stop worker ``name`` and start it again (same ports, a new Dynamo instance id); ``env``: settings
        over the kind's command for this start (a user's engine setting, e.g. vLLM's hash encoding).

        Returns once the new instance is registered and the old one is gone from discovery, so
        the router has been told of both; the ``restart_forgotten`` check starts from there.
        """
        old = self.workers[name]
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        self.group.stop_one(name)
        spec = self.kind.command(old.spec, self.plan)
        self.group.start(dataclasses.replace(spec, env={**spec.env, **env}) if env else spec)
        handle = self._await_registration(old.spec, deadline, replacing=old.instance_id)
        store = self.plan.discovery_store
        while any(i.instance_id == old.instance_id for i in discovery.instances(store)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}'s old instance {old.instance_id} is still registered after its restart")
            time.sleep(0.2)
        self.workers[name] = handle
        return handle

    def restart_router(self, replica: int, timeout_s: float | None = None, *, routers: RouterSetup | None = None) -> float:
        """Stop router replica ``replica`` (its frontend process) and start it again on the same
        port; returns the seconds until it served the model again. What its router knew is gone:
        on start it rebuilds the prefix state from the workers' local indexers (Dynamo 1.6.1).
        ``routers``: the replicas' setup from now on (a replica restarted with other flags, e.g.
        without replica sync); the same count of replicas."""
        if routers is not None:
            if routers.count != self.plan.routers.count:
                raise ValueError(f"a restart keeps {self.plan.routers.count} routers, not {routers.count}")
            self.plan = dataclasses.replace(self.plan, routers=routers)
        self.group.stop_one(self.plan.frontend_spec(replica).name)
        spec = self.plan.frontend_spec(replica)
        self.group.start(spec)
        return wait_ready(self.plan.frontend_urls[replica], self.model,
                          timeout_s=timeout_s or self.startup_timeout_s, alive=self.group.check_alive)

    def interrupt_event_plane(self) -> None:
        """Stop the event plane's own process (the ZMQ broker, or nats-server): every KV event and
        every replica-sync event published until :meth:`resume_event_plane` reaches no router."""
        self.group.stop_one(self._event_plane_spec().name)

    def resume_event_plane(self) -> None:
        """Start the event plane again on the same ports; Dynamo's publishers and subscribers
        reconnect by themselves."""
        spec = self._event_plane_spec()
        self.group.start(spec)
        if spec.name == "nats":
            deadline = time.monotonic() + self.startup_timeout_s
            while not nats_ready(self.plan.nats_port):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nats-server did not serve again within {self.startup_timeout_s:.0f}s")
                time.sleep(0.1)

    def _event_plane_spec(self) -> ProcessSpec:
        name = "nats" if self.plan.control_plane == "etcd-nats" else "broker"
        return next(s for s in self.plan.infrastructure_specs() if s.name == name)

    def _await_registration(self, w: WorkerSpec, deadline: float, *, replacing: int | None = None) -> WorkerHandle:
        ports = self.plan.worker_ports[w.name]
        store = self.plan.discovery_store
        while time.monotonic() < deadline:
            self.group.check_alive()
            inst = discovery.instance_on_port(store, ports.rpc)
            if inst is not None and inst.instance_id == replacing:
                inst = None  # the stopped process's registration, not yet withdrawn
            card = discovery.card_for(store, inst.instance_id) if inst else None
            if inst and card:
                ep = self.plan.kv_events_connect(w) if w.publishes_kv_events else None
                return WorkerHandle(w, ports, inst.instance_id, card.enable_eagle, ep)
            time.sleep(0.2)
        raise TimeoutError(f"{w.name} did not register with discovery within {self.startup_timeout_s:.0f}s "
                           f"(log: {self.group.log_dir / (w.name + '.log')})")

    def close(self, *, failed: bool = False) -> None:
        """Stop capture and processes; drop the run dir unless it failed or ``keep_logs``."""
        for capture in (self.capture, self.router_capture):
            if capture is not None:
                capture.close()
        self.capture = self.router_capture = None
        self.group.stop()
        if not failed and not self.keep_logs:
            shutil.rmtree(self.plan.run_dir, ignore_errors=True)
