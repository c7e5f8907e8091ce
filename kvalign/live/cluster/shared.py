"""Live clusters shared by the tests of one configuration: started once, flushed between users.

Why: a live test spends most of its time starting its cluster (workers registering, the frontend
coming up), while the tests of one configuration differ only in what they send through it. A
configuration is everything that decides what was launched (:class:`ClusterKey`: engine, SGLang
release, topology with its registration flags, control plane, the worker kind's and the plan's
other knobs), and :class:`SharedClusters` starts each at most once, so long as it stays healthy.

Reuse is only safe if the next user cannot tell a reused cluster from a cold one, so before every
hand-out (the first one included: every user starts from the same state, whatever ran before):

1. **health**: every process alive, every worker still registered under the instance id the
   cluster holds, the frontend still listing the model. A cluster that fails this (a crash, a
   test that closed it) is closed and a fresh one started: it is not the next user's failure;
2. **flush**: every worker's cache through Dynamo's own ``clear_kv_blocks`` endpoint
   (:func:`~kvalign.live.cluster.control.clear_kv_blocks`, what the fuzz driver flushes real
   SGLang workers with), confirmed on the **engine's side** by SGLang's ``AllBlocksCleared`` from
   every publishing worker, in a fresh KV-event capture that becomes the user's
   ``cluster.capture`` (writing under the user's own run directory), and on the **router's side**
   by the frontend's ``kv_cache_events_applied{event_type="cleared",status="ok"}`` counter rising
   by one per publishing worker flushed: the router's index applied every clear. A flush that is
   not confirmed within its bounds also means a fresh cluster.

:meth:`SharedClusters.close` stops every cluster and returns the processes of any run that
outlived it (found by the run marker, however they were spawned).
"""

from __future__ import annotations

import importlib.metadata
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import requests

from kvalign.errors import UsageError
from kvalign.model.events import AllBlocksCleared
from kvalign.live.cluster import discovery
from kvalign.live.cluster.control import ControlError, clear_kv_blocks
from kvalign.live.cluster.lifecycle import Cluster, make_plan
from kvalign.live.cluster.processes import ProcessExited, pids_with_env
from kvalign.live.cluster.topology import RUN_MARKER_ENV, ControlPlane, Topology, WorkerKind
from kvalign.live.wire.capture import Captured, EventCapture
from kvalign.live.wire.metrics import MetricsSnapshot, scrape

#: The frontend's counter of KV events its router's index applied (Dynamo 1.6.1, prefixed
#: ``dynamo_component_``), labelled by ``event_type`` and ``status``.
EVENTS_APPLIED = "kv_cache_events_applied"

#: Bounds of one flush: the engine's ``AllBlocksCleared`` per attempt, and the router's count.
ENGINE_CLEAR_WAIT_S = 5.0
ROUTER_CLEAR_WAIT_S = 10.0
#: Flush attempts before the cluster counts as unhealthy (a fresh capture's subscription can miss
#: the first ``AllBlocksCleared`` when it joins late: ZMQ PUB drops what precedes a subscription).
FLUSH_ATTEMPTS = 3


class ClusterUnhealthy(RuntimeError):
    """A shared cluster cannot be handed out as it is (the pool then starts a fresh one)."""


@dataclass(frozen=True)
class ClusterKey:
    """Everything that decides what a cluster launched: equal keys, interchangeable clusters."""

    engine: str  # the worker kind's name
    release: str | None  # the SGLang release the workers run
    topology: Topology  # roles, EAGLE and registered enable_eagle per worker, page size
    control_plane: ControlPlane
    knobs: tuple[tuple[str, str], ...]  # the worker kind's settings and the plan's other options

    @classmethod
    def of(cls, topology: Topology, kind: WorkerKind, control_plane: ControlPlane = "file",
           **plan_kw: object) -> "ClusterKey":
        release = getattr(kind, "sglang_version", None) or _installed("sglang")
        knobs = {**{f"kind.{k}": repr(v) for k, v in vars(kind).items()}, **{k: repr(v) for k, v in plan_kw.items()}}
        return cls(kind.name, release, topology, control_plane, tuple(sorted(knobs.items())))

    @property
    def slug(self) -> str:
        """A short, file-name-safe description (the shared run directory's prefix)."""
        roles = "-".join(f"{role}{len(self.topology.by_role(role))}" for role in ("agg", "prefill", "decode")
                         if self.topology.by_role(role))
        w = self.topology.workers[0]
        mode = "eagle" if w.eagle else "plain"
        register = "" if w.register_eagle is None else f"-register_{'on' if w.register_eagle else 'off'}"
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{self.engine}-{roles}-{mode}{register}-{self.control_plane}")

    def describe(self) -> str:
        """The slug with the release and every other knob: two configurations never read alike."""
        return f"{self.slug} (sglang {self.release}; {', '.join(f'{k}={v}' for k, v in self.knobs)})"


def _installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cleared_applied(frontend_url: str) -> float:
    """How many ``AllBlocksCleared`` the frontend's router index has applied, over all workers."""
    try:
        snap = scrape(f"{frontend_url}/metrics")
    except UsageError as exc:
        raise ClusterUnhealthy(f"the frontend's metrics are unreadable: {exc}") from None
    return events_applied(snap, event_type="cleared", status="ok") or 0.0


def events_applied(snap: MetricsSnapshot, **labels: str) -> float | None:
    """Sum of the frontend's ``kv_cache_events_applied`` samples whose labels have these values
    (None when there is no such sample: the frontend exports none yet, or another name)."""
    # prometheus_client names a counter's samples ``..._total`` even where Dynamo exports no suffix
    found = [s.value for s in snap.samples if s.name.removesuffix("_total").endswith(EVENTS_APPLIED)
             and all(dict(s.labels).get(k) == v for k, v in labels.items())]
    return float(sum(found)) if found else None


def check_health(cluster: Cluster) -> None:
    """Raise :class:`ClusterUnhealthy` naming what is wrong with ``cluster`` (nothing: it may be reused)."""
    if cluster.capture is None:
        raise ClusterUnhealthy("the cluster was closed")
    try:
        cluster.group.check_alive()
    except ProcessExited as exc:
        raise ClusterUnhealthy(str(exc).splitlines()[0]) from None
    store = cluster.plan.discovery_store
    for name, handle in cluster.workers.items():
        inst = discovery.instance_on_port(store, handle.ports.rpc)
        if inst is None or inst.instance_id != handle.instance_id:
            raise ClusterUnhealthy(f"{name} is no longer registered as instance {handle.instance_id}")
    try:
        r = requests.get(f"{cluster.frontend_url}/v1/models", timeout=5.0)
        listed = [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else []
    except (requests.RequestException, ValueError) as exc:
        raise ClusterUnhealthy(f"the frontend does not answer /v1/models: {exc}") from None
    if cluster.model not in listed:
        raise ClusterUnhealthy(f"the frontend no longer lists {cluster.model!r} (lists {listed})")


def flush(cluster: Cluster, capture_dir: Path) -> EventCapture:
    """Flush every worker, confirmed on the engine's and the router's side; returns the fresh
    capture (already ``cluster.capture``) that saw the flush. Raises :class:`ClusterUnhealthy`."""
    publishing = {name: h.kv_events_endpoint for name, h in cluster.workers.items() if h.kv_events_endpoint}
    capture = EventCapture(publishing, capture_dir=capture_dir)
    try:
        router_before = cleared_applied(cluster.frontend_url)
        pending, issued = set(cluster.workers), 0
        for _attempt in range(FLUSH_ATTEMPTS):
            by_component: dict[str, list[int]] = {}
            for name in sorted(pending):
                handle = cluster.workers[name]
                by_component.setdefault(handle.spec.component, []).append(handle.instance_id)
            try:
                for component, ids in by_component.items():
                    clear_kv_blocks(cluster.plan, component, ids)
            except ControlError as exc:
                raise ClusterUnhealthy(str(exc)) from None
            issued += len(pending & set(publishing))
            capture.wait_for(lambda snap: _cleared(snap) >= set(publishing), ENGINE_CLEAR_WAIT_S)
            pending = set(publishing) - _cleared(capture.snapshot())
            if not pending:
                break
        if pending:
            raise ClusterUnhealthy(f"no AllBlocksCleared from {sorted(pending)} after {FLUSH_ATTEMPTS} flushes")
        deadline = time.monotonic() + ROUTER_CLEAR_WAIT_S
        while (applied := cleared_applied(cluster.frontend_url) - router_before) < issued:
            if time.monotonic() > deadline:
                raise ClusterUnhealthy(f"the router applied {applied:g} of the {issued} clears within "
                                       f"{ROUTER_CLEAR_WAIT_S:.0f}s")
            time.sleep(0.1)
    except BaseException:
        capture.close()
        raise
    if cluster.capture is not None:
        cluster.capture.close()
    cluster.capture = capture
    return capture


def _cleared(snapshot: list[Captured]) -> set[str]:
    """Labels whose captured stream holds an ``AllBlocksCleared``."""
    return {c.label for c in snapshot if any(isinstance(ev, AllBlocksCleared) for ev in c.batch.events)}


class SharedClusters:
    """At most one running cluster per :class:`ClusterKey`, each under its own run directory."""

    def __init__(self, run_dir_for: Callable[[ClusterKey], Path], *, startup_timeout_s: float = 90.0,
                 log: Callable[[str], None] = lambda _msg: None) -> None:
        """``run_dir_for(key)``: a new directory for a cluster of ``key`` (a restart gets another);
        ``log``: where the pool says which cluster it replaced, and why."""
        self.run_dir_for, self.startup_timeout_s, self.log = run_dir_for, startup_timeout_s, log
        self.clusters: dict[ClusterKey, Cluster] = {}
        self.starts: dict[ClusterKey, int] = {}
        self.reuses: dict[ClusterKey, int] = {}
        self.run_dirs: list[Path] = []
        self.kept: set[Path] = set()  # run directories whose logs explain a failure or a replacement

    def get(self, topology: Topology, kind: WorkerKind, capture_dir: Path, *, control_plane: ControlPlane = "file",
            **plan_kw: object) -> Cluster:
        """A healthy cluster of this configuration, flushed, with a fresh capture under ``capture_dir``."""
        key = ClusterKey.of(topology, kind, control_plane, **plan_kw)
        cluster = self.clusters.get(key)
        if cluster is not None:
            try:
                check_health(cluster)
                flush(cluster, capture_dir)
                self.reuses[key] = self.reuses.get(key, 0) + 1
                return cluster
            except ClusterUnhealthy as exc:
                self.log(f"replacing the shared {key.describe()} cluster ({cluster.plan.run_dir}): {exc}")
                self.discard(cluster)
        run_dir = self.run_dir_for(key).resolve()
        self.run_dirs.append(run_dir)
        cluster = Cluster(make_plan(topology, run_dir, control_plane=control_plane, **plan_kw), kind,
                          startup_timeout_s=self.startup_timeout_s).__enter__()
        self.clusters[key] = cluster
        self.starts[key] = self.starts.get(key, 0) + 1
        try:
            flush(cluster, capture_dir)
        except ClusterUnhealthy:
            self.discard(cluster)
            raise
        return cluster

    def discard(self, cluster: Cluster) -> None:
        """Stop ``cluster`` and keep its run directory; the next :meth:`get` of its key starts afresh."""
        for key, held in list(self.clusters.items()):
            if held is cluster:
                del self.clusters[key]
        self.kept.add(cluster.plan.run_dir)
        cluster.close(failed=True)

    def close(self) -> dict[Path, list[int]]:
        """Stop every cluster; returns, per run directory, the processes that outlived it."""
        for cluster in list(self.clusters.values()):
            cluster.close()
        self.clusters.clear()
        leftovers = {d: pids_with_env(RUN_MARKER_ENV, str(d)) for d in self.run_dirs}
        return {d: pids for d, pids in leftovers.items() if pids}
