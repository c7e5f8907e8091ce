"""The fuzz's cluster, planned in one place: :func:`plan_fuzz` turns :class:`~.options.FuzzOptions`
into one frozen :class:`FuzzPlan`, and :func:`fuzz_cluster` starts what it says.

Why one module: a fuzz cluster is decided by a dozen options — the topology and its data-parallel
ranks, the engine and its release, the router replicas, the lossy hop between every publishing
source and Dynamo's relay, and the workers' own settings (a pool small enough to evict, the KV-event
format, what they record). They are taken here in one order — topology, the engine's plan (models,
release, ports: :func:`~kvalign.live.engines.sglang_cpu.plan_engine`), router replicas, the hop's
ports, then the worker kind built once with every setting — so a reader follows the options from
``kvalign e2e fuzz`` to the processes in one file, and nothing is patched into the plan or the kind
afterwards. The hop and :class:`~kvalign.live.cluster.lifecycle.Cluster` only read the plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvalign.live.cluster import ranks
from kvalign.live.cluster.lifecycle import Cluster, with_routers
from kvalign.live.cluster.ports import PortPool
from kvalign.live.cluster.topology import ClusterPlan, Topology, WorkerKind, WorkerSpec
from kvalign.live.runs.fuzz.dp_ranks import relay_subscriptions
from kvalign.live.wire.lossy_hop import LossyHop
from kvalign.live.runs.fuzz.options import FuzzOptions

DECODE_POOL_TOKENS = 4096  # the decode worker's pool in disaggregation (see SglangCpuWorkerKind)


@dataclass(frozen=True)
class FuzzPlan:
    """Everything a fuzz cluster is started from: nothing here changes once the run starts."""

    cluster: ClusterPlan  # topology, ports, model and router replicas
    kind: WorkerKind  # the workers' commands, every setting given at construction
    sources: Mapping[str, tuple[WorkerSpec, int]]  # label -> (worker, rank): one per publishing worker or rank
    upstream: Mapping[str, str]  # label -> SGLang's KV-event PUB, which the hop subscribes to
    downstream: Mapping[str, int]  # label -> the hop's PUB that Dynamo's relay reads (the router's view)
    taps: Mapping[str, int]  # label -> the hop's unaltered copy of SGLang's stream (kvalign's engine view)
    silenced: frozenset[str] = frozenset()  # sources the hop keeps silent (--only-rank0-publishes)

    @property
    def labels(self) -> list[str]:
        return list(self.sources)


def fuzz_topology(opts: FuzzOptions) -> Topology:
    """The workers: EAGLE3 everywhere (registered without it for the cache-blind control); vLLM's
    aggregated workers key plain blocks and run no speculative decoder."""
    if opts.engine == "vllm-cpu":
        return Topology.aggregated(opts.workers, eagle=False, page_size=opts.page_size)
    register = None if opts.router_eagle else False
    if opts.topology == "disagg":
        return Topology.disaggregated(opts.workers, 1, eagle=True, register_eagle=register, page_size=opts.page_size)
    return Topology.aggregated(opts.workers, eagle=True, register_eagle=register, page_size=opts.page_size,
                               dp_size=opts.dp_size, dp_attention=opts.dp_attention)


def _hop_ports(plan: ClusterPlan, labels: list[str], *, taken: Sequence[int] = (), what: str = "hop") -> dict[str, int]:
    """A loopback port per worker for one of the hop's PUBs, distinct from every plan port."""
    pool = PortPool()
    taken = [*taken, *plan.all_ports()]
    pool.assigned.update({f"plan.{i}": p for i, p in enumerate(taken) if p is not None})
    return {label: pool.take(f"{label}.{what}") for label in labels}



def plan_fuzz(opts: FuzzOptions, run_dir: str | Path) -> FuzzPlan:
    """The cluster ``opts`` asks for (builds the tiny models under ``run_dir``, allocates every port)."""
    topology = fuzz_topology(opts)
    if opts.engine == "vllm-cpu":
        from kvalign.live.engines import vllm_cpu

        cluster, kind_of = vllm_cpu.plan_engine(topology, run_dir)
    elif opts.engine == "sglang-gpu":
        from kvalign.live.engines import sglang_gpu

        cluster, kind_of = sglang_gpu.plan_engine(topology, run_dir, draft=opts.draft, hicache=opts.hicache,
                                                  transfer=opts.transfer or "nixl")
    else:
        from kvalign.live.engines import sglang_cpu

        cluster, kind_of = sglang_cpu.plan_engine(topology, run_dir, draft=opts.draft, sglang_version=opts.sglang,
                                                  hicache=opts.hicache, transfer=opts.transfer)
    cluster = with_routers(cluster, opts.router_setup())
    sources = ranks.sources(cluster)  # one per publishing worker, or per rank of a data-parallel one
    labels = list(sources)
    downstream = _hop_ports(cluster, labels)
    taps = _hop_ports(cluster, labels, taken=list(downstream.values()), what="tap")
    relays = relay_subscriptions(cluster, downstream)
    if opts.engine == "vllm-cpu":  # vLLM's workers: a pool small enough to evict, the relay on the hop; no SGLang setting
        kind = kind_of(max_total_tokens=opts.max_total_tokens, relay_subscribe=relays)
    else:
        kind = kind_of(max_total_tokens=opts.max_total_tokens,  # the publishing workers': small, so they evict
                       decode_max_total_tokens=DECODE_POOL_TOKENS, relay_subscribe=relays,
                       event_format=opts.event_format, record_server_info=True,
                       publisher_faults_dir=Path(run_dir) / "publisher-faults" if opts.publisher_faults else None)
    return FuzzPlan(cluster, kind, sources,
                    upstream={label: cluster.kv_events_connect(w, rank) for label, (w, rank) in sources.items()},
                    downstream=downstream, taps=taps,
                    silenced=frozenset(label for label, (_w, rank) in sources.items() if opts.rank0_only and rank != 0))


@contextlib.contextmanager
def fuzz_cluster(opts: FuzzOptions, run_dir: str | Path) -> Iterator[tuple[Cluster, LossyHop]]:
    """The real workers, frontend, router and lossy hop of :func:`plan_fuzz`; torn down on exit.

    Aggregated workers cache their own generated tokens and publish them, so a follow-up reuses
    them; prefill workers do not (they never decode), which a follow-up on ``disagg`` checks live.
    """
    plan = plan_fuzz(opts, run_dir)
    with LossyHop(dict(plan.upstream), dict(plan.downstream), strip_salt=opts.strip_salt, hide_gaps=opts.hide_gaps,
                  taps=dict(plan.taps)) as hop:
        hop.silenced = set(plan.silenced)
        with Cluster(plan.cluster, plan.kind, startup_timeout_s=opts.startup_timeout_s, router_view=hop.downstream,
                     engine_view=hop.taps) as cluster:
            yield cluster, hop
