"""The real-engine CPU worker kind: ``python -m dynamo.sglang --device cpu`` with EAGLE3.

The same Dynamo worker, SGLang scheduler, speculative decoder, radix cache and KV-event publisher
as the GPU nightly, on this machine's CPU, serving the tiny offline models of
:mod:`kvalign.live.engines.engine_model`. Everything kvalign adds to the SGLang processes comes from
:mod:`kvalign.standins.sglang_cpu` (kernel stand-ins + patches), loaded through ``PYTHONPATH`` of
these worker processes only.

Settings and why (sglang-cpu-engine.md):

* ``--attention-backend torch_native --disable-cuda-graph --disable-overlap-schedule``: the only
  attention backend and schedule that run without the CPU build of sgl-kernel;
* EAGLE3 with ``--speculative-num-steps 1 --speculative-eagle-topk 1
  --speculative-num-draft-tokens 2``: num-steps >= 2 needs a multi-step draft-decode attention
  backend and topk > 1 a tree mask, neither of which torch_native has;
* prefill/decode with ``--disaggregation-transfer-backend nixl`` (SGLang's NIXL path moves each
  request's KV pages between the processes' host memory, UCX over TCP on 127.0.0.1,
  ``SGLANG_HOST_IP=127.0.0.1`` so nothing advertises a LAN address) and
  ``--disaggregation-enable-kv-checksum`` on both sides (SGLang digests the pages on prefill and
  verifies them on decode; :mod:`kvalign.standins.sglang_cpu.kv_transfer` stands in for the CUDA
  digest kernel and the VRAM label); ``--transfer fake`` moves nothing (the decode half's negative
  control); decode ``--disaggregation-decode-retraction-backup cpu_tensor`` (the default host pool
  calls ``torch.cuda.cudart()``);
* ``--host 127.0.0.1`` and the KV-event PUB bound on loopback; ``--enable-metrics
  --decode-log-interval 1`` so the spec gauges refresh every verify step;
* ``--nccl-port`` from the cluster's port pool: SGLang before 0.5.23 takes an ephemeral port for
  its ``torch.distributed`` store and binds it seconds later, long enough for another process's
  outgoing connection to take it (:class:`~kvalign.live.cluster.topology.WorkerPorts`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from kvalign.releases.release_env import python_for
from kvalign.standins import sglang_cpu as sglang_cpu_standin
from kvalign.live.cluster.lifecycle import make_plan
from kvalign.live.engines.dp_workers import dp_args, dp_problem, threads_bind
from kvalign.live.engines.engine_model import TARGET_NAME, Draft, Pair, write_models
from kvalign.live.engines.hicache import HiCache
from kvalign.live.cluster.processes import ProcessSpec
from kvalign.live.engines.sglang_worker import RELAY_SUBSCRIBE_ENV, ROUTER_EAGLE_ENV, SERVER_INFO_ENV
from kvalign.live.cluster.ports import LOOPBACK
from kvalign.standins.sglang_cpu.forkserver import FORKSERVER_ENV
from kvalign.standins.sglang_cpu.kv_transfer import CHECKSUM_INJECTOR_ARM_ENV, CHECKSUM_LEDGER_ENV
from kvalign.oracles.sglang import torch_extensions_dir
from kvalign.live.cluster.topology import ClusterPlan, ControlPlane, Topology, WorkerSpec


@dataclass(frozen=True)
class CpuEagle:
    """EAGLE3 settings that run on torch_native (one draft step, a chain of one draft token)."""

    num_steps: int = 1
    eagle_topk: int = 1
    num_draft_tokens: int = 2

    def __post_init__(self) -> None:
        if (self.num_steps, self.eagle_topk) != (1, 1) or self.num_draft_tokens != 2:
            raise ValueError("on CPU, EAGLE3 runs only with --speculative-num-steps 1 --speculative-eagle-topk 1 "
                             "--speculative-num-draft-tokens 2 (torch_native has no multi-step draft or tree mask)")

    def args(self, draft_model: str) -> list[str]:
        return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft_model,
                "--speculative-num-steps", str(self.num_steps), "--speculative-eagle-topk", str(self.eagle_topk),
                "--speculative-num-draft-tokens", str(self.num_draft_tokens)]


class SglangCpuWorkerKind:
    """Builds each worker's real ``dynamo.sglang`` command on CPU (a :class:`WorkerKind`).

    ``sglang_dir``: a release from ``kvalign matrix``'s wheel cache: the workers are started by the
    interpreter of its own environment (:func:`kvalign.releases.release_env.python_for`, with the plan's Dynamo
    release when it has one), the stand-in alone on ``PYTHONPATH``; None runs the environment's.
    """

    name = "sglang-cpu"

    def __init__(self, draft_model: str | None, *, eagle: CpuEagle = CpuEagle(), max_total_tokens: int = 4096,
                 threads: int = 1, sglang_version: str = sglang_cpu_standin.SGLANG_VERSION,
                 sglang_dir: Path | None = None, relay_subscribe: Mapping[str, str] | None = None,
                 sleep_on_idle: bool = True, hicache: HiCache | None = None,
                 extra_env: Mapping[str, str] | None = None, transfer: str = "nixl",
                 checksum_injector: bool = False, decode_max_total_tokens: int | None = None,
                 event_format: str = "default", record_server_info: bool = False,
                 publisher_faults_dir: Path | None = None, forkserver: bool = True) -> None:
        if transfer not in TRANSFER_BACKENDS:
            raise ValueError(f"transfer backend must be one of {', '.join(TRANSFER_BACKENDS)}, got {transfer!r}")
        self.draft_model, self.eagle = draft_model, eagle
        #: SGLang's transfer backend between prefill and decode (:data:`TRANSFER_BACKENDS`)
        self.transfer_backend = transfer
        #: a test control: decode workers load the hook that arms SGLang's checksum-mismatch injector
        #: (:func:`checksum_injector_arm_path`)
        self.checksum_injector = checksum_injector
        #: SGLang's host tier on the workers that cache prompts (aggregated and prefill), or None
        self.hicache = hicache
        #: SGLang's ``--sleep-on-idle`` (0.5.19, 0.5.21, 0.5.23): without it each scheduler spins a core
        #: while it has nothing to do, so a 3-worker cluster on two cores starves the router, the
        #: harness and everything else on the machine. A fully idle scheduler then blocks in
        #: ``zmq.Poller.poll`` on its tokenizer and RPC sockets, waking on the next request; it
        #: publishes its KV events before it sleeps and never sleeps with a transfer in flight.
        #: ``bench/bench_live_idle.py`` measures the difference.
        self.sleep_on_idle = sleep_on_idle
        #: each worker's ``OMP_NUM_THREADS``: one. Torch's second OpenMP thread buys nothing on the tiny models
        #: and, with two or more schedulers (and the router, the harness, the other test worker) on two cores,
        #: every parallel region waits at its barrier for a thread that is not running: a 2-worker cluster
        #: answered 24 requests in 37.7-64.0 s on 26.4-27.4 CPU-s with two threads, 4.0-6.1 s on 3.9-4.5 CPU-s
        #: with one (two rounds, each order once, load 7-17)
        self.max_total_tokens, self.threads = max_total_tokens, threads
        #: the decode workers' pool when it must differ (a small prefill pool that evicts): SGLang's
        #: decode pre-allocation reserves ``--num-reserved-decode-tokens`` (512) per request, so a
        #: 512-token decode pool admits no request and every hand-off waits forever
        self.decode_max_total_tokens = decode_max_total_tokens
        self.sglang_version, self.sglang_dir = sglang_version, sglang_dir
        self.release = sglang_cpu_standin.SUPPORTED[sglang_version]
        self.relay_subscribe = dict(relay_subscribe or {})  # worker name -> the fuzz's lossy-hop endpoint
        #: SGLang's KV-event format (``--kv-events-config``'s ``format``; "dynamo" from SGLang 0.5.23)
        self.event_format = event_format
        #: publishing workers record SGLang's /server_info KV-event descriptor (:func:`server_info_path`)
        self.record_server_info = record_server_info
        #: a test control (the fuzz's ``publisher_faults``): each publishing worker loads kvalign's
        #: publisher-fault hook, armed through ``<dir>/<worker>.json`` (never set on the normal path)
        self.publisher_faults_dir = publisher_faults_dir
        self.extra_env = dict(extra_env or {})  # e.g. a stand-in switched on for this run only
        #: SGLang's scheduler and detokenizer forked from one fork server that imported SGLang once,
        #: not spawned (each spawned child re-imports torch/transformers/SGLang, ~9-10 CPU-s):
        #: :mod:`kvalign.standins.sglang_cpu.forkserver`; a 1-worker cluster starts in 24.7 CPU-s, not 33.1. The
        #: fork server is itself a fork of the worker, taken before Dynamo's runtime starts: a 2 prefill + 1 decode
        #: cluster was ready in 29.6 s on 44.2 CPU-s, 84.4 s on 107.0 CPU-s with the server spawned
        self.forkserver = forkserver

    def _kv_ipc(self, worker: WorkerSpec, plan: ClusterPlan) -> str:
        """The IPC endpoint ``worker``'s SGLang binds for its events (releases without ``bind``)."""
        path = plan.run_dir / "kv" / f"{worker.name}.ipc"
        if len(str(path)) > IPC_PATH_MAX:  # the kernel's limit for a Unix socket path
            path = Path(tempfile.gettempdir()) / f"kvalign-{plan.namespace}-{worker.name}.ipc"
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"ipc://{path}"

    def _python(self, plan: ClusterPlan) -> str:
        """The workers' interpreter: the release's environment when the workers run another SGLang."""
        if self.sglang_dir is None:
            return plan.python
        return python_for([d for d in (plan.dynamo_dir, self.sglang_dir) if d is not None])

    def support_specs(self, plan: ClusterPlan) -> list[ProcessSpec]:
        """A loopback KV-event forwarder per publishing worker when the release cannot bind."""
        if self.release.kv_events_bind:
            return []
        return [ProcessSpec(f"{w.name}.kv-forwarder",
                            [plan.python, "-m", "kvalign.live.wire.kv_forwarder", self._kv_ipc(w, plan), plan.kv_events_connect(w)],
                            infrastructure=True)
                for w in plan.topology.workers if w.publishes_kv_events]

    def command(self, worker: WorkerSpec, plan: ClusterPlan) -> ProcessSpec:
        if worker.eagle and not self.draft_model:
            raise ValueError(f"{worker.name} runs EAGLE3 but no draft model was given")
        ports = plan.worker_ports[worker.name]
        dp = ports.kv_ranks  # data-parallel ranks (kvalign.live.engines.dp_workers)
        attention = dp > 1 and plan.topology.dp_attention  # one TP group: its ranks share one --nccl-port
        forced_off = worker.eagle and worker.register_eagle is False
        hop = self.relay_subscribe.get(worker.name)
        recording = self.record_server_info and worker.publishes_kv_events
        wrapped = forced_off or hop is not None or recording
        entry = ["-m", "kvalign.live.engines.sglang_worker"] if wrapped else ["-m", "dynamo.sglang"]
        argv = [
            self._python(plan), *entry, "--model-path", plan.model_path, "--served-model-name", plan.model_name,
            *self.device_args(worker, plan), "--page-size", str(plan.topology.page_size),
            "--max-total-tokens", str(self.decode_max_total_tokens if worker.role == "decode" and self.decode_max_total_tokens
                                     else self.max_total_tokens), "--host", "127.0.0.1", "--enable-metrics",
            *(["--nccl-port", str(ports.nccl)] if dp == 1 or attention else []),
            *(["--sleep-on-idle"] if self.sleep_on_idle else []), *dp_args(dp, attention),
        ]
        if worker.publishes_kv_events:
            config = plan.kv_events_config(worker, bind=self.release.kv_events_bind)
            if self.event_format != "default":
                config = json.dumps({**json.loads(config), "format": self.event_format})
            argv += ["--kv-events-config", config]
        if worker.role != "agg":
            argv += ["--disaggregation-mode", worker.role, "--disaggregation-transfer-backend", self.transfer_backend,
                     "--disaggregation-bootstrap-port", str(ports.bootstrap)]
            if self.transfer_backend != "fake":  # fake sends no digest: there is nothing to verify
                argv += ["--disaggregation-enable-kv-checksum"]
        if worker.role == "decode":
            argv += self.decode_args()
        elif self.hicache is not None:
            argv += [*self.hicache.args(), *self.hicache.storage_args(plan.topology.page_size)]
        if worker.role != "prefill":
            argv += ["--decode-log-interval", "1"]
        if worker.eagle:
            argv += self.eagle.args(str(self.draft_model))
        env = {
            **plan.worker_env(worker), **self.device_env(worker),
            "OMP_NUM_THREADS": str(self.threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TORCH_EXTENSIONS_DIR": torch_extensions_dir(self.sglang_version), **NO_CRASH_DIAGNOSTICS,
            **({ROUTER_EAGLE_ENV: "off"} if forced_off else {}), **({RELAY_SUBSCRIBE_ENV: hop} if hop else {}),
            **({SERVER_INFO_ENV: str(server_info_path(plan, worker))} if recording else {}),
            **self.extra_env,
        }
        if worker.role != "agg":
            env.update(self.transfer_env(worker, plan))
        if self.hicache is not None and worker.role != "decode":
            env.update(self.hicache.storage_env(storage_dir(plan, worker)))
        if dp > 1:
            env["SGLANG_CPU_OMP_THREADS_BIND"] = threads_bind(dp)
        if worker.publishes_kv_events and not self.release.kv_events_bind:
            env[sglang_cpu_standin.KV_EVENTS_IPC_ENV] = self._kv_ipc(worker, plan)
        if worker.publishes_kv_events and self.publisher_faults_dir is not None:
            env[sglang_cpu_standin.PUBLISHER_FAULTS_ENV] = str(self.publisher_faults_dir / f"{worker.name}.json")
        return ProcessSpec(worker.name, argv, env)

    def transfer_env(self, worker: WorkerSpec, plan: ClusterPlan) -> dict[str, str]:
        """A disaggregated worker's transfer settings: every address SGLang advertises or binds for
        the hand-off is 127.0.0.1 (its own choice may be a LAN address), NIXL's UCX runs over TCP on
        the loopback device, and the decode worker records each checksum verification."""
        env = {"SGLANG_HOST_IP": LOOPBACK}
        if self.transfer_backend == "nixl":
            env |= {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "lo"}
        if worker.role == "decode" and self.transfer_backend != "fake":  # fake: no checksum runs
            env[CHECKSUM_LEDGER_ENV] = str(checksum_ledger_path(plan, worker))
            if self.checksum_injector:
                env[CHECKSUM_INJECTOR_ARM_ENV] = str(checksum_injector_arm_path(plan))
        return env

    def device_args(self, worker: WorkerSpec, plan: ClusterPlan) -> list[str]:
        """The flags that put SGLang on this CPU (the module docstring says why each)."""
        return ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                "--disable-overlap-schedule"]

    def decode_args(self) -> list[str]:
        """A decode worker's own flags: the default retraction backup calls ``torch.cuda.cudart()``."""
        return ["--disaggregation-decode-retraction-backup", "cpu_tensor"]

    def device_env(self, worker: WorkerSpec) -> dict[str, str]:
        """The CPU stand-in, loaded through the worker's ``PYTHONPATH``."""
        env = sglang_cpu_standin.worker_env(None if self.sglang_dir else os.environ.get("PYTHONPATH") or None)
        return env | ({FORKSERVER_ENV: "1"} if self.forkserver else {})


#: SGLang's crash diagnostics, off on CPU. Stopping a worker (its process group gets SIGTERM) kills the
#: scheduler first; SGLang's subprocess watchdog then raises SIGQUIT in ``dynamo.sglang``, whose handler
#: (``dump_requests_before_crash``, 0.5.21 and 0.5.23) sleeps 5 s "to let GPU activity settle" before a
#: py-spy dump and a CUDA coredump, both on by default: here there is no GPU, no CUDA and no py-spy, so
#: every cluster stop and every fuzz restart waited 5 s for nothing (the requests' dump, when
#: ``--crash-dump-folder`` is set, still runs).
NO_CRASH_DIAGNOSTICS = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


#: SGLang's prefill->decode transfer backends the CPU workers run: ``nixl`` moves the KV pages (host
#: memory, UCX over TCP on 127.0.0.1, :mod:`kvalign.standins.sglang_cpu.kv_transfer`) and both sides
#: run SGLang's KV checksum; ``fake`` moves nothing (the negative control: decode without the KV).
TRANSFER_BACKENDS = ("nixl", "fake")


def checksum_ledger_path(plan: ClusterPlan, worker: WorkerSpec) -> Path:
    """Where ``worker`` (decode) records SGLang's checksum verifications, one JSON line a request."""
    path = plan.run_dir / "kv" / f"{worker.name}.checksums.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def storage_dir(plan: ClusterPlan, worker: WorkerSpec) -> Path:
    """The worker's own directory for HiCache's ``file`` storage tier (a restart finds its pages there)."""
    return Path(plan.run_dir) / "storage" / worker.name


def server_info_path(plan: ClusterPlan, worker: WorkerSpec) -> Path:
    """Where ``worker`` records SGLang's ``/server_info`` KV-event descriptor (``KVALIGN_SERVER_INFO``)."""
    path = plan.run_dir / "kv" / f"{worker.name}.server-info.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


#: Longest ``ipc://`` socket path (Linux ``sun_path`` is 108 bytes with the terminator).
IPC_PATH_MAX = 100

#: Modules the real engine needs beyond the fake-CPU live stack (scripts/requirements-engine-cpu.txt).
ENGINE_MODULES = ("dynamo.sglang", "safetensors", "jsonschema", "blake3", "nixl")


def engine_problem(sglang_version: str | None = None) -> str | None:
    """Why the real SGLang engine (the environment's, or release ``sglang_version`` from the wheel
    cache) cannot run on this CPU (None when it can)."""
    import importlib.util

    problem = sglang_cpu_standin.version_problem(sglang_version)
    if problem:
        return problem
    for mod in ENGINE_MODULES:
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            return f"{mod} is not importable: run scripts/setup.sh (it installs the real engine's CPU packages)"
    return None


def release_dir(sglang_version: str | None) -> tuple[str, Path | None]:
    """(the SGLang release the workers run, its wheel-cache directory or None for the environment's).

    A release other than the environment's is installed into ``kvalign matrix``'s per-version cache
    (with its pinned dependency set) on first use."""
    from kvalign.verify.report.matrix import ensure_release, installed

    version = sglang_version or installed("sglang") or sglang_cpu_standin.SGLANG_VERSION
    problem = sglang_cpu_standin.version_problem(version)
    if problem:
        raise RuntimeError(problem)
    return version, ensure_release("sglang", version)


def plan_cluster(topology: Topology, run_dir: str | Path, *, draft: Draft = "agree",
                 control_plane: ControlPlane = "file", sglang_version: str | None = None,
                 hicache: HiCache | None = None, pair: Pair = "zero-head", transfer: str | None = None,
                 checksum_mismatch_prob: float = 0.0) -> tuple[ClusterPlan, SglangCpuWorkerKind]:
    """Plan a real-engine CPU run with the kind's default worker settings (:func:`plan_engine`)."""
    plan, kind = plan_engine(topology, run_dir, draft=draft, control_plane=control_plane,
                             sglang_version=sglang_version, hicache=hicache, pair=pair, transfer=transfer,
                             checksum_mismatch_prob=checksum_mismatch_prob)
    return plan, kind()


def plan_engine(topology: Topology, run_dir: str | Path, *, draft: Draft = "agree",
                control_plane: ControlPlane = "file", sglang_version: str | None = None,
                hicache: HiCache | None = None, pair: Pair = "zero-head", transfer: str | None = None,
                checksum_mismatch_prob: float = 0.0) -> tuple[ClusterPlan, Callable[..., SglangCpuWorkerKind]]:
    """Plan a real-engine CPU run: the tiny models (``pair``) are built under ``run_dir/models`` (a few
    hundred KB, so every run builds its own) and served as :data:`TARGET_NAME`; ``transfer`` is SGLang's
    prefill->decode backend (None: the release's, :attr:`~kvalign.standins.sglang_cpu.Release.transfer`) and
    ``checksum_mismatch_prob`` SGLang's own checksum-mismatch injector.

    The kind comes back unbuilt, its constructor with the engine's arguments bound: a run calls it
    once with its own worker settings (:class:`SglangCpuWorkerKind`'s keywords), including those
    that depend on the plan's ports (the fuzz's relay hops), so no setting is patched in later."""
    version, sglang_dir = release_dir(sglang_version)
    if hicache is not None:
        from kvalign.live.engines.hicache import problem

        if (why := problem(version)) is not None:
            raise RuntimeError(why)
    if (why := dp_problem(version, topology.dp_size)) is not None:
        raise RuntimeError(why)
    run = Path(run_dir).resolve()
    target, draft_dir = write_models(run / "models", draft, pair=pair)
    plan = make_plan(topology, run, str(target), model_name=TARGET_NAME, control_plane=control_plane)
    return plan, partial(SglangCpuWorkerKind, str(draft_dir), sglang_version=version, sglang_dir=sglang_dir,
                         hicache=hicache, transfer=transfer or sglang_cpu_standin.SUPPORTED[version].transfer,
                         checksum_injector=checksum_mismatch_prob > 0)


def checksum_injector_arm_path(plan: ClusterPlan) -> Path:
    """The file whose probability arms SGLang's checksum-mismatch injector in the decode workers
    (:data:`~kvalign.standins.sglang_cpu.kv_transfer.CHECKSUM_INJECTOR_ARM_ENV`): written by the run
    once the cluster is up, so the harness's readiness request still passes."""
    path = plan.run_dir / "kv" / "checksum-injector.arm"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
