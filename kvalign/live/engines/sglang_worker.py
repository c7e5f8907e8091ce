"""The GPU worker kind: ``python -m dynamo.sglang`` with EAGLE3 and the launch defaults that work.

Every default here is the fix for a failure seen upstream (live-e2e.md §1.5, §3, §6):

* ``--host 0.0.0.0`` on every SGLang worker: SGLang's bootstrap server binds ``--host``
  (127.0.0.1 by default) while ``dynamo.sglang`` advertises ``get_local_ip_auto()``, so decode
  got "connection refused" (sgl-project/sglang#9931). The shared plan env also sets
  ``SGLANG_HOST_IP=127.0.0.1`` so the *advertised* address is loopback;
* a distinct ``--disaggregation-bootstrap-port``, ``--kv-events-config`` port and
  ``DYN_SYSTEM_PORT`` per worker: two prefill workers on one host collide on SGLang's 8998;
* ``--nccl-port`` from the same pool: SGLang before 0.5.23 picks an ephemeral port for its
  ``torch.distributed`` store and binds it only once the scheduler starts (EADDRINUSE if another
  process's connection took it meanwhile);
* ``--enable-metrics --decode-log-interval 1`` on decode: the spec gauges refresh only every
  ``decode_log_interval`` forwards (default 40), more than 4 short requests make;
* ``--page-size 16`` = the router's ``--kv-cache-block-size``; ``PYTHONHASHSEED=0``,
  ``UCX_TLS=^mm``, ``HF_HUB_OFFLINE=1`` (weights must already be on the machine).

The KV-event endpoint is ``tcp://*:<port>`` with ``--host 0.0.0.0``: SGLang before 0.5.23
(``ai-dynamo[sglang]`` 1.6.1 pins 0.5.21) has no ``bind`` key and binds only wildcard
endpoints. ``bind_host="127.0.0.1"`` keeps both sockets on loopback instead (sglang >= 0.5.23).

Negative control: a worker whose ``register_eagle`` is False runs through this module's
``main``, which forces ``dynamo.sglang``'s router-facing ``enable_eagle`` off while the engine
keeps its bigram-keyed radix cache: the cache-blind bug of Dynamo #10982/#11764, on purpose.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from kvalign.live.cluster.processes import ProcessSpec
from kvalign.live.cluster.topology import ClusterPlan, Topology, WorkerSpec

#: kvalign's tiny target and EAGLE3 draft (:mod:`.engine_model`), written on the machine that runs them:
#: the default, since a GPU machine reaches no model hub. ``KVALIGN_MODEL`` / ``KVALIGN_DRAFT_MODEL``
#: name a real pair instead (e.g. Qwen/Qwen3-8B with Tengyunw/qwen3_8b_eagle3, already downloaded).
TINY_MODEL = "kvalign-tiny"
DEFAULT_MODEL = DEFAULT_DRAFT_MODEL = TINY_MODEL
MODEL_ENV, DRAFT_MODEL_ENV = "KVALIGN_MODEL", "KVALIGN_DRAFT_MODEL"
ROUTER_EAGLE_ENV = "KVALIGN_ROUTER_EAGLE"

#: Fraction of a GPU's memory that the SGLang workers placed on it share (static: weights + KV).
GPU_MEMORY_BUDGET = 0.8


def default_models(env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """Model and draft model: ``KVALIGN_MODEL`` / ``KVALIGN_DRAFT_MODEL`` or kvalign's tiny pair."""
    env = os.environ if env is None else env
    return env.get(MODEL_ENV) or DEFAULT_MODEL, env.get(DRAFT_MODEL_ENV) or DEFAULT_DRAFT_MODEL


def router_eagle_from(value: str | None) -> bool:
    """Parse the negative-control switch (``--kvalign-router-eagle`` / ``KVALIGN_ROUTER_EAGLE``)."""
    if value is None or value.strip().lower() in ("", "on", "auto", "1", "true"):
        return True
    if value.strip().lower() in ("off", "0", "false"):
        return False
    raise ValueError(f"router eagle switch must be 'on' or 'off', got {value!r}")


@dataclass(frozen=True)
class EagleConfig:
    """EAGLE3 settings of Dynamo's EAGLE tests (``agg_spec_decoding.sh``)."""

    algorithm: str = "EAGLE3"
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4

    def args(self, draft_model: str) -> list[str]:
        return [
            "--speculative-algorithm", self.algorithm, "--speculative-draft-model-path", draft_model,
            "--speculative-num-steps", str(self.num_steps), "--speculative-eagle-topk", str(self.eagle_topk),
            "--speculative-num-draft-tokens", str(self.num_draft_tokens),
        ]


def gpu_topology(*, single_gpu: bool = False, prefill: int = 2, decode: int = 1, router_eagle: bool = True,
                 page_size: int = 16) -> Topology:
    """The PR's topology: prefill workers on GPU 0, decode on GPU 1 (or everything on GPU 0)."""
    return Topology.disaggregated(
        prefill, decode, eagle=True, register_eagle=None if router_eagle else False, page_size=page_size,
        prefill_gpu=0, decode_gpu=0 if single_gpu else 1,
    )


class SglangWorkerKind:
    """Builds each worker's ``python -m dynamo.sglang`` command (a :class:`WorkerKind`)."""

    name = "sglang"

    def __init__(
        self, draft_model: str, *, eagle: EagleConfig = EagleConfig(), transfer_backend: str = "nixl",
        mem_fraction_static: float | None = None, context_length: int | None = 4096, cuda_graph: bool = False,
        bind_host: str = "0.0.0.0",
    ) -> None:
        if bind_host not in ("0.0.0.0", "127.0.0.1"):
            raise ValueError(f"bind host must be 0.0.0.0 or 127.0.0.1, got {bind_host!r}")
        if mem_fraction_static is not None and not 0 < mem_fraction_static < 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {mem_fraction_static}")
        self.draft_model, self.eagle = draft_model, eagle
        self.transfer_backend = transfer_backend
        self.mem_fraction_static = mem_fraction_static
        self.context_length, self.cuda_graph, self.bind_host = context_length, cuda_graph, bind_host

    def mem_fraction(self, worker: WorkerSpec, plan: ClusterPlan) -> float:
        """The GPU budget split evenly between the workers sharing ``worker``'s GPU."""
        if self.mem_fraction_static is not None:
            return self.mem_fraction_static
        sharing = sum(1 for w in plan.topology.workers if w.gpu == worker.gpu)
        return int(GPU_MEMORY_BUDGET / sharing * 100) / 100

    def kv_events_config(self, worker: WorkerSpec, plan: ClusterPlan) -> str:
        if self.bind_host == "127.0.0.1":
            return plan.kv_events_config(worker)
        port = plan.worker_ports[worker.name].kv_events
        return json.dumps({"publisher": "zmq", "topic": "kv-events", "endpoint": f"tcp://*:{port}"})

    def command(self, worker: WorkerSpec, plan: ClusterPlan) -> ProcessSpec:
        if worker.role == "agg":
            raise ValueError("the GPU layer runs prefill/decode disaggregation; got an aggregated worker")
        if worker.gpu is None:
            raise ValueError(f"{worker.name} has no GPU assigned")
        ports = plan.worker_ports[worker.name]
        forced_off = worker.eagle and worker.register_eagle is False
        entry = ["-m", "kvalign.live.engines.sglang_worker"] if forced_off else ["-m", "dynamo.sglang"]
        argv = [
            plan.python, *entry, "--model-path", plan.model_path, "--served-model-name", plan.model_name,
            "--page-size", str(plan.topology.page_size),
            "--mem-fraction-static", f"{self.mem_fraction(worker, plan):g}",
            "--host", self.bind_host,
            "--disaggregation-mode", worker.role, "--disaggregation-transfer-backend", self.transfer_backend,
            "--disaggregation-bootstrap-port", str(ports.bootstrap), "--nccl-port", str(ports.nccl),
            "--kv-events-config", self.kv_events_config(worker, plan),
        ]
        if self.context_length:
            argv += ["--context-length", str(self.context_length)]
        if not self.cuda_graph:
            argv += ["--disable-cuda-graph"]
        if worker.eagle:
            argv += self.eagle.args(self.draft_model)
        if worker.role == "decode":
            argv += ["--enable-metrics", "--decode-log-interval", "1"]
        env = {
            **plan.worker_env(worker), "CUDA_VISIBLE_DEVICES": str(worker.gpu), "UCX_TLS": "^mm",
            "HF_HUB_OFFLINE": "1", **({ROUTER_EAGLE_ENV: "off"} if forced_off else {}),
        }
        return ProcessSpec(worker.name, argv, env)

    def support_specs(self, plan: ClusterPlan) -> list[ProcessSpec]:
        """None: the pinned SGLang binds its own KV-event PUB (``bind`` in its config)."""
        return []


def force_router_eagle_off() -> None:
    """Make ``dynamo.sglang`` register ``enable_eagle=False`` whatever the algorithm.

    Fails loudly if Dynamo renamed the hook: a negative control that silently stays positive
    would "prove" nothing.
    """
    import dynamo.sglang.register as register

    if not callable(getattr(register, "_eagle_enabled_for", None)):
        raise SystemExit(
            "kvalign: cannot force router eagle off: dynamo.sglang.register has no _eagle_enabled_for "
            "(Dynamo changed how it derives enable_eagle)"
        )
    register._eagle_enabled_for = lambda speculative_algorithm: False


#: Where ``dynamo.sglang``'s relay subscribes instead of SGLang's own PUB (the fuzz's lossy hop).
RELAY_SUBSCRIBE_ENV = "KVALIGN_RELAY_SUBSCRIBE"
#: A file the worker writes SGLang's own ``/server_info`` KV-event descriptor to, once its engine resolved.
SERVER_INFO_ENV = "KVALIGN_SERVER_INFO"


def record_server_info(path: str) -> None:
    """Write, once ``sgl.Engine`` has resolved its arguments, what SGLang's HTTP ``/server_info`` would
    advertise for this worker's KV events (``describe_kv_events_publisher``, the ``kv_events`` block of
    ``build_server_info``) and its resolved page size, to ``path`` (JSON).

    ``dynamo.sglang`` serves no SGLang HTTP server, so the descriptor is computed in the worker by
    SGLang's own function on the engine's own ``server_args``: ``init_llm`` hands them to
    ``Config.use_resolved_server_args`` right after the engine starts, and that one method is wrapped
    (it still runs). Fails loudly if Dynamo renamed it."""
    import dynamo.sglang.args as args_mod

    config = getattr(args_mod, "Config", None)
    original = getattr(config, "use_resolved_server_args", None)
    if not callable(original):
        raise SystemExit("kvalign: cannot record SGLang's /server_info descriptor: dynamo.sglang.args.Config has no "
                         "use_resolved_server_args (Dynamo changed where it reads the engine's arguments)")

    def use_resolved_server_args(self: object, server_args: object) -> object:
        from sglang.srt.arg_groups.overrides import resolving_view
        from sglang.srt.runtime_context import describe_kv_events_publisher

        info = {"kv_events": describe_kv_events_publisher(server_args),
                "page_size": int(resolving_view(server_args).page_size)}
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(info, fh)
        os.replace(tmp, path)
        return original(self, server_args)

    config.use_resolved_server_args = use_resolved_server_args


def relay_via(endpoint: str) -> None:
    """Make ``dynamo.sglang``'s KV-event relay subscribe to ``endpoint`` (a loopback hop) instead
    of the endpoint SGLang binds; SGLang itself still publishes where its config says.

    ``endpoint`` may also be a JSON object mapping each endpoint the relay would subscribe to (one
    per data-parallel rank, SGLang's port + rank) to its hop: every rank then goes through its own
    hop, and a rank the map does not name stops the worker (a rank the hop bypasses would drop
    nothing).

    The relay derives its SUB address with ``publisher.format_zmq_endpoint`` (1.6.1); only that
    name in ``dynamo.sglang.publisher`` is replaced, so SGLang's processes are untouched. Fails
    loudly if Dynamo renamed it: a hop the relay bypasses would drop nothing.
    """
    import dynamo.sglang.publisher as publisher

    original = getattr(publisher, "format_zmq_endpoint", None)
    if not callable(original):
        raise SystemExit("kvalign: cannot route KV events through the hop: dynamo.sglang.publisher has no "
                         "format_zmq_endpoint (Dynamo changed how its relay finds SGLang's publisher)")
    publisher.format_zmq_endpoint = subscribe_via(original, endpoint)


def subscribe_via(original: Callable[[str, str], str], endpoint: str) -> Callable[[str, str], str]:
    """The replacement for ``format_zmq_endpoint`` (``original``): every subscription to ``endpoint``,
    or, for a JSON map, each one to the hop its own address maps to (:func:`relay_via`)."""
    if not endpoint.lstrip().startswith("{"):
        return lambda endpoint_template, ip_address: endpoint
    hops = json.loads(endpoint)

    def via_hop(endpoint_template: str, ip_address: str) -> str:
        own = original(endpoint_template, ip_address)
        if own not in hops:
            raise SystemExit(f"kvalign: the relay subscribes to {own}, which no hop serves ({sorted(hops)})")
        return hops[own]

    return via_hop


def main(argv: list[str] | None = None) -> None:
    """``python -m kvalign.live.engines.sglang_worker ARGS``: ``python -m dynamo.sglang ARGS`` with the
    router-facing ``enable_eagle`` forced off (the negative control, ``KVALIGN_ROUTER_EAGLE=off``),
    the relay subscribed through a loopback hop (``KVALIGN_RELAY_SUBSCRIBE``) and/or SGLang's
    ``/server_info`` KV-event descriptor recorded (``KVALIGN_SERVER_INFO``)."""
    os.environ.setdefault("PYTHONHASHSEED", "0")  # as dynamo.sglang.__main__, for SGLang's children
    if not router_eagle_from(os.environ.get(ROUTER_EAGLE_ENV)):
        force_router_eagle_off()
    if os.environ.get(RELAY_SUBSCRIBE_ENV):
        relay_via(os.environ[RELAY_SUBSCRIBE_ENV])
    if os.environ.get(SERVER_INFO_ENV):
        record_server_info(os.environ[SERVER_INFO_ENV])
    from dynamo.sglang.main import main as dynamo_main

    sys.argv = ["dynamo.sglang", *(sys.argv[1:] if argv is None else argv)]
    dynamo_main()


if __name__ == "__main__":
    main()
