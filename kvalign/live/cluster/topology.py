"""What a live run launches: the topology, its ports and environment, and the worker command.

One harness serves the CPU live tests and the GPU nightly. Everything except the worker's
command line is shared and lives here or in :mod:`kvalign.live.cluster.lifecycle`: the roles and their
Dynamo components, the ports each worker needs, the control-plane settings (:data:`CONTROL_PLANES`),
the 127.0.0.1-only host settings, and the frontend command. A :class:`WorkerKind` turns one
:class:`WorkerSpec` into a :class:`~kvalign.live.cluster.processes.ProcessSpec`; the CPU kind is
:class:`CpuWorkerKind` (``python -m kvalign.live.engines.fake_cpu_worker``), the GPU kind builds
``python -m dynamo.sglang``.

Loopback settings (checked against ai-dynamo-runtime 1.6.1): ``DYN_TCP_RPC_HOST`` (request
plane bind and advertised address), ``DYN_TCP_RESPONSE_STREAM_HOST``, ``DYN_SYSTEM_HOST``
(metrics/health server), ``DYN_EVENT_PLANE_HOST`` (advertised event-plane address), frontend
``--http-host``, and the event-plane broker (:mod:`kvalign.live.cluster.broker`), because a direct-mode
event-plane publisher always binds ``tcp://0.0.0.0:0``. SGLang side: ``SGLANG_HOST_IP`` /
``HOST_IP`` (what ``get_local_ip_auto`` returns).

Control planes (env names read from the 1.6.1 binary): ``file`` (default) needs no service —
``DYN_DISCOVERY_BACKEND=file`` + ``DYN_FILE_KV``, tcp request plane, zmq event plane through the
loopback broker. ``etcd-nats`` is Dynamo's own test setup: an ``etcd`` and a ``nats-server`` on
loopback ports, ``DYN_DISCOVERY_BACKEND=etcd`` + ``ETCD_ENDPOINTS``, ``NATS_SERVER``, KV events on
the NATS event plane (NATS Core, no JetStream — Dynamo's default, non-durable events). The
request plane stays tcp in both: instance records then carry the worker's pinned
``DYN_TCP_RPC_PORT``, which is how the harness tells workers apart in discovery (a nats request
plane registers only a subject, ``ns_component.generate-<id>``, nothing that names the process).
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, Protocol

from kvalign.live.cluster.broker import broker_url
from kvalign.live.cluster.discovery import EtcdStore, Store
from kvalign.live.cluster.ports import LOOPBACK, PortPool
from kvalign.live.cluster.processes import ProcessSpec
from kvalign.live.cluster.routers import RouterSetup, frontend_process_name

Role = Literal["agg", "prefill", "decode"]
ControlPlane = Literal["file", "etcd-nats"]
CONTROL_PLANES: tuple[ControlPlane, ...] = ("file", "etcd-nats")

#: Set on every process of a run: finds leftovers of a run by environment, whatever their argv.
RUN_MARKER_ENV = "KVALIGN_LIVE_RUN"

#: Dynamo component per role, as ``dynamo.sglang`` names them (``args.py``).
COMPONENT: dict[Role, str] = {"agg": "backend", "prefill": "prefill", "decode": "backend"}


@dataclass(frozen=True)
class WorkerSpec:
    """One worker of a topology.

    ``eagle``: the engine runs an EAGLE-family speculative algorithm, so its radix cache is
    bigram-keyed. ``register_eagle``: the ``enable_eagle`` it registers with the router;
    ``None`` derives it as ``dynamo.sglang`` does (equal to ``eagle``); ``False`` with
    ``eagle=True`` is the cache-blind negative control.
    """

    name: str
    role: Role
    eagle: bool
    register_eagle: bool | None = None
    gpu: int | None = None

    @property
    def component(self) -> str:
        return COMPONENT[self.role]

    @property
    def publishes_kv_events(self) -> bool:
        """Aggregated and prefill workers feed the router's index; decode workers do not."""
        return self.role != "decode"


@dataclass(frozen=True)
class Topology:
    """The workers of a run and the KV block (page) size they and the router share."""

    workers: tuple[WorkerSpec, ...]
    page_size: int = 16
    #: SGLang's ``--dp-size`` of every aggregated worker: that many schedulers, KV caches and KV-event
    #: streams per worker (ports ``kv_events + rank``), one Dynamo worker routed by (instance, dp_rank)
    dp_size: int = 1
    #: the ranks are attention-DP groups of one TP group (``--tp-size N --attn-dp-size N``), not replicas
    dp_attention: bool = False

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"--dp-size must be >= 1, got {self.dp_size}")
        if self.dp_attention and self.dp_size < 2:
            raise ValueError("--dp-attention needs --dp-size 2 or more")
        if self.dp_size > 1 and self.disaggregated_mode:
            raise ValueError("--dp-size runs aggregated workers only (the disaggregated fake transfer is not "
                             "checked across data-parallel ranks)")

    @classmethod
    def aggregated(cls, n: int, *, eagle: bool, register_eagle: bool | None = None, page_size: int = 16,
                   dp_size: int = 1, dp_attention: bool = False) -> "Topology":
        return cls(tuple(WorkerSpec(f"worker{i}", "agg", eagle, register_eagle) for i in range(n)), page_size, dp_size,
                   dp_attention)

    @classmethod
    def disaggregated(
        cls, prefill: int, decode: int, *, eagle: bool, register_eagle: bool | None = None, page_size: int = 16,
        prefill_gpu: int | None = None, decode_gpu: int | None = None,
    ) -> "Topology":
        ws = [WorkerSpec(f"prefill{i}", "prefill", eagle, register_eagle, prefill_gpu) for i in range(prefill)]
        ws += [WorkerSpec(f"decode{i}", "decode", eagle, register_eagle, decode_gpu) for i in range(decode)]
        return cls(tuple(ws), page_size)

    @property
    def disaggregated_mode(self) -> bool:
        return any(w.role == "prefill" for w in self.workers)

    def by_role(self, role: Role) -> list[WorkerSpec]:
        return [w for w in self.workers if w.role == role]


@dataclass(frozen=True)
class WorkerPorts:
    """Loopback ports one worker binds: request plane, SGLang KV-event PUB, system, bootstrap, and
    the TCP store of SGLang's ``torch.distributed`` group (``--nccl-port``).

    ``nccl`` is ours because SGLang before 0.5.23 picks it itself with a bind to port 0, i.e. from
    the ephemeral range, and binds it only seconds later when the scheduler starts: an outgoing
    connection of any process can take it in between (EADDRINUSE, seen in a CI-style run on 0.5.21).
    """

    rpc: int
    kv_events: int  # rank 0's; a data-parallel worker's rank r publishes on kv_events + r
    system: int
    bootstrap: int
    nccl: int
    kv_ranks: int = 1  # how many consecutive KV-event ports from kv_events (SGLang's --dp-size)

    @classmethod
    def allocate(cls, pool: PortPool, name: str, *, kv_ranks: int = 1) -> "WorkerPorts":
        ports = {f.name: (pool.take_range(f"{name}.{f.name}", kv_ranks) if f.name == "kv_events"
                          else pool.take(f"{name}.{f.name}")) for f in fields(cls) if f.name != "kv_ranks"}
        return cls(**ports, kv_ranks=kv_ranks)

    def all(self) -> tuple[int, ...]:
        """Every port of the worker, for callers that must keep clear of them."""
        return (self.rpc, *range(self.kv_events, self.kv_events + self.kv_ranks), self.system, self.bootstrap, self.nccl)


def response_stream_host(dynamo_version: str | None) -> str:
    """``DYN_TCP_RESPONSE_STREAM_HOST`` for loopback: before Dynamo 1.6 it names an *interface*
    ("Interface not found: 127.0.0.1" otherwise), so older releases get ``lo``."""
    if dynamo_version is None:
        return LOOPBACK
    release = tuple(int(x) for x in dynamo_version.split("+")[0].split(".")[:2] if x.isdigit())
    return LOOPBACK if release >= (1, 6) else "lo"


@dataclass(frozen=True)
class ClusterPlan:
    """Everything fixed before launch: shared by ``kvalign live up``, pytest and ``e2e plan``."""

    topology: Topology
    namespace: str
    model_path: str
    model_name: str
    run_dir: Path
    http_port: int
    broker_xsub: int | None = None  # file control plane: the zmq event-plane broker
    broker_xpub: int | None = None
    worker_ports: dict[str, WorkerPorts] = field(default_factory=dict)
    python: str = sys.executable
    control_plane: ControlPlane = "file"
    etcd_client: int | None = None  # etcd-nats control plane
    etcd_peer: int | None = None
    nats_port: int | None = None
    dynamo_dir: Path | None = None  # another Dynamo release (kvalign matrix's wheel cache), run by ``python``
    dynamo_version: str | None = None
    routers: RouterSetup = field(default_factory=RouterSetup)  # frontend replicas (kvalign.live.cluster.routers)
    router_http_ports: tuple[int, ...] = ()  # HTTP ports of replicas 1.. (replica 0 serves on http_port)

    def __post_init__(self) -> None:
        need = {"file": ("broker_xsub", "broker_xpub"), "etcd-nats": ("etcd_client", "etcd_peer", "nats_port")}
        if self.control_plane not in need:
            raise ValueError(f"unknown control plane {self.control_plane!r} (choose from {', '.join(CONTROL_PLANES)})")
        missing = [f for f in need[self.control_plane] if getattr(self, f) is None]
        if missing:
            raise ValueError(f"control plane {self.control_plane!r} needs ports {missing}")

    @property
    def file_kv(self) -> Path:
        return self.run_dir / "discovery"

    @property
    def discovery_store(self) -> Store:
        """Where the harness reads registrations: the file store or etcd."""
        return EtcdStore(self.etcd_url) if self.control_plane == "etcd-nats" else self.file_kv

    @property
    def etcd_url(self) -> str:
        return f"http://{LOOPBACK}:{self.etcd_client}"

    @property
    def nats_url(self) -> str:
        return f"nats://{LOOPBACK}:{self.nats_port}"

    @property
    def planes(self) -> dict[str, str]:
        """Discovery backend, request plane and event plane, as the Dynamo CLIs name them."""
        if self.control_plane == "etcd-nats":
            return {"discovery-backend": "etcd", "request-plane": "tcp", "event-plane": "nats"}
        return {"discovery-backend": "file", "request-plane": "tcp", "event-plane": "zmq"}

    @property
    def frontend_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def frontend_urls(self) -> list[str]:
        """Every router replica's HTTP address, replica 0 (:attr:`frontend_url`) first."""
        return [f"http://{LOOPBACK}:{p}" for p in (self.http_port, *self.router_http_ports)]

    def all_ports(self) -> list[int]:
        """Every loopback port the plan assigned, for callers that must keep clear of them."""
        ports = [self.http_port, *self.router_http_ports, self.broker_xsub, self.broker_xpub, self.etcd_client,
                 self.etcd_peer, self.nats_port, *(p for wp in self.worker_ports.values() for p in wp.all())]
        return [p for p in ports if p is not None]

    def plane_env(self) -> dict[str, str]:
        """Environment every Dynamo process gets: the control plane's settings, loopback only."""
        planes = self.planes
        if self.control_plane == "etcd-nats":
            control = {"ETCD_ENDPOINTS": self.etcd_url, "NATS_SERVER": self.nats_url}
        else:
            control = {"DYN_FILE_KV": str(self.file_kv), "DYN_ZMQ_BROKER_URL": broker_url(
                f"tcp://{LOOPBACK}:{self.broker_xsub}", f"tcp://{LOOPBACK}:{self.broker_xpub}")}
        return {
            RUN_MARKER_ENV: str(self.run_dir),
            "DYN_DISCOVERY_BACKEND": planes["discovery-backend"],
            "DYN_REQUEST_PLANE": planes["request-plane"],
            "DYN_EVENT_PLANE": planes["event-plane"],
            **control,
            "DYN_NAMESPACE": self.namespace,
            "DYN_TCP_RPC_HOST": LOOPBACK,
            "DYN_TCP_RESPONSE_STREAM_HOST": response_stream_host(self.dynamo_version),
            "DYN_EVENT_PLANE_HOST": LOOPBACK,
            "DYN_SYSTEM_HOST": LOOPBACK,
            "SGLANG_HOST_IP": LOOPBACK,
            "HOST_IP": LOOPBACK,
            "PYTHONHASHSEED": "0",
            "PYTHONUNBUFFERED": "1",
            **self.release_path(),
        }

    def release_path(self) -> dict[str, str]:
        """Every process of a cluster on another Dynamo release runs that release: ``python`` is the
        interpreter of the release's own environment (frontend, runtime bindings, relay); an
        inherited ``PYTHONPATH`` would come before its site-packages, so it is emptied."""
        return {} if self.dynamo_dir is None else {"PYTHONPATH": ""}

    def worker_env(self, worker: WorkerSpec) -> dict[str, str]:
        """Plane env plus this worker's own request-plane and system ports.

        Pinning ``DYN_TCP_RPC_PORT`` is what lets the harness find the worker's Dynamo instance
        id in discovery (its transport address), for any worker kind.
        """
        ports = self.worker_ports[worker.name]
        return {**self.plane_env(), "DYN_TCP_RPC_PORT": str(ports.rpc), "DYN_SYSTEM_PORT": str(ports.system)}

    def kv_events_config(self, worker: WorkerSpec, *, host: str = LOOPBACK, bind: bool = True) -> str:
        """SGLang's ``--kv-events-config`` JSON for ``worker`` (bound, not connected).

        ``bind=False`` for a release whose config has no ``bind`` key (before 0.5.23): the key
        would be dropped silently, so it is left out and a forwarder binds the address instead."""
        port = self.worker_ports[worker.name].kv_events
        config: dict[str, object] = {"publisher": "zmq", "topic": "", "endpoint": f"tcp://{host}:{port}"}
        if bind:
            config["bind"] = True
        return json.dumps(config)

    def kv_events_connect(self, worker: WorkerSpec, rank: int = 0) -> str:
        """Where a subscriber on this machine reaches ``worker``'s SGLang KV-event PUB (data-parallel
        rank ``rank``'s: SGLang offsets the configured port by the rank)."""
        ports = self.worker_ports[worker.name]
        if not 0 <= rank < ports.kv_ranks:
            raise ValueError(f"{worker.name} has {ports.kv_ranks} KV-event rank(s), not rank {rank}")
        return f"tcp://{LOOPBACK}:{ports.kv_events + rank}"

    def frontend_spec(self, replica: int = 0) -> ProcessSpec:
        """``python -m dynamo.frontend --router-mode kv`` on loopback, for this namespace; ``replica``
        picks one of :attr:`routers`' replicas (its own HTTP port and router flags)."""
        min_workers = len(self.topology.by_role("decode") or self.topology.by_role("agg"))
        port = self.http_port if replica == 0 else self.router_http_ports[replica - 1]
        return ProcessSpec(
            frontend_process_name(replica),
            [self.python, "-m", "dynamo.frontend", "--router-mode", "kv", "--http-host", LOOPBACK,
             "--http-port", str(port), "--namespace", self.namespace,
             "--kv-cache-block-size", str(self.topology.page_size),
             *(a for flag, value in self.planes.items() for a in (f"--{flag}", value)), *self.routers.flags(replica)],
            {**self.plane_env(), "DYN_ROUTER_MIN_INITIAL_WORKERS": str(min_workers)},
        )

    def frontend_specs(self) -> list[ProcessSpec]:
        """One :meth:`frontend_spec` per router replica."""
        return [self.frontend_spec(i) for i in range(self.routers.count)]

    def infrastructure_specs(self) -> list[ProcessSpec]:
        """The control plane's own processes, started first and stopped last."""
        if self.control_plane == "etcd-nats":
            return [self.etcd_spec(), self.nats_spec()]
        return [self.broker_spec()]

    def etcd_spec(self) -> ProcessSpec:
        """A single-member etcd whose client and peer URLs are loopback, data under the run dir."""
        peer = f"http://{LOOPBACK}:{self.etcd_peer}"
        return ProcessSpec(
            "etcd",
            [control_binary("etcd"), "--name", "kvalign", "--data-dir", str(self.run_dir / "etcd"),
             "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"kvalign={peer}", "--initial-cluster-state", "new", "--logger", "zap"],
            {RUN_MARKER_ENV: str(self.run_dir)},
            infrastructure=True,
        )

    def nats_spec(self) -> ProcessSpec:
        """NATS Core on loopback: Dynamo's non-durable KV events need no JetStream."""
        return ProcessSpec(
            "nats",
            [control_binary("nats-server"), "-a", LOOPBACK, "-p", str(self.nats_port)],
            {RUN_MARKER_ENV: str(self.run_dir)},
            infrastructure=True,
        )

    def broker_spec(self) -> ProcessSpec:
        return ProcessSpec(
            "broker",
            [self.python, "-m", "kvalign.live.cluster.broker", "--xsub", f"tcp://{LOOPBACK}:{self.broker_xsub}",
             "--xpub", f"tcp://{LOOPBACK}:{self.broker_xpub}"],
            {RUN_MARKER_ENV: str(self.run_dir)},
            infrastructure=True,
        )


#: Debian's nats-server lives in /usr/sbin, which is not on an unprivileged user's PATH.
_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")


def control_binary(name: str) -> str:
    """Absolute path of ``etcd`` / ``nats-server`` if installed, else the bare name (for plans)."""
    return shutil.which(name) or shutil.which(name, path=":".join(_SBIN_DIRS)) or name


def control_plane_missing(control_plane: ControlPlane) -> str | None:
    """Why ``control_plane`` cannot run here (None when it can): the binaries it needs."""
    if control_plane == "file":
        return None
    absent = [b for b in ("etcd", "nats-server") if control_binary(b) == b]
    if not absent:
        return None
    return (f"--control-plane etcd-nats needs {' and '.join(absent)} on PATH or in /usr/sbin "
            "(Debian: apt-get install etcd-server nats-server; scripts/setup.sh installs them)")


class WorkerKind(Protocol):
    """Builds the command of one worker; the only part that differs between CPU and GPU runs."""

    name: str

    def command(self, worker: WorkerSpec, plan: ClusterPlan) -> ProcessSpec: ...

    def support_specs(self, plan: ClusterPlan) -> list[ProcessSpec]:
        """Processes this kind's workers need started before them (e.g. a KV-event forwarder)."""
        ...


class CpuWorkerKind:
    """``python -m kvalign.live.engines.fake_cpu_worker``: real Dynamo runtime + SGLang radix cache, no model."""

    name = "cpu"

    def __init__(self, token_delay_ms: float = 2.0, *, bootstrap_endpoint: bool = True):
        self.token_delay_ms = token_delay_ms
        self.bootstrap_endpoint = bootstrap_endpoint

    def command(self, worker: WorkerSpec, plan: ClusterPlan) -> ProcessSpec:
        ports = plan.worker_ports[worker.name]
        mode = {"agg": "null", "prefill": "prefill", "decode": "decode"}[worker.role]
        argv = [
            plan.python, "-m", "kvalign.live.engines.fake_cpu_worker", "--model-path", plan.model_path,
            "--served-model-name", plan.model_name, "--namespace", plan.namespace,
            "--component", worker.component, "--page-size", str(plan.topology.page_size),
            "--disaggregation-mode", mode, "--disaggregation-bootstrap-port", str(ports.bootstrap),
            "--token-delay-ms", str(self.token_delay_ms),
        ]
        if worker.eagle:
            argv += ["--speculative-algorithm", "EAGLE3"]
        if worker.register_eagle is not None:
            argv += ["--register-eagle", "on" if worker.register_eagle else "off"]
        if worker.publishes_kv_events:
            argv += ["--kv-events-config", plan.kv_events_config(worker)]
        if worker.role == "prefill" and not self.bootstrap_endpoint:
            argv += ["--no-bootstrap-endpoint"]
        return ProcessSpec(worker.name, argv, plan.worker_env(worker))

    def support_specs(self, plan: ClusterPlan) -> list[ProcessSpec]:
        """None: the fake worker binds its own KV-event PUB."""
        return []
