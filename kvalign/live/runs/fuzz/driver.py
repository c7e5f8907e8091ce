"""The fuzz cluster and the steps a generated (or replayed) workload runs on it.

:func:`fuzz_cluster` starts real workers behind the real frontend and KV router — two aggregated
EAGLE3 workers, or the nightly's 2 prefill + 1 decode — each publishing worker's KV events passing
through a :class:`~kvalign.live.wire.lossy_hop.LossyHop` on their way to Dynamo's relay, with
kvalign capturing both sides of the hop. :class:`FuzzDriver` runs one JSON-able step at a time —
the Hypothesis machine and ``--replay`` call the same code — and checks every answered request
(:mod:`.invariants`) before the next step.

Settling (bounded, never after an outcome is seen): before a request is sent, the driver waits
until no capture has received a batch for ``quiet_s`` (the engine's previous events are all out
and the router, a few milliseconds behind on loopback, has them), at most ``settle_timeout_s``.
A prediction is taken at the marks of that moment, so a request is never re-sent or re-checked
to make a disagreement go away.

Every fault a step injects is observed by a later request of the same step: a ``fill`` re-queries
its first prompt (whose pages the later fill prompts evicted), a ``flush`` re-queries the flushed
worker's latest prompt on that worker, a ``drop_batch`` follows up on the lost pages.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvalign.model.causes import Cause
from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvalign.live.cluster.control import ControlError, clear_kv_blocks
from kvalign.live.cluster import ranks
from kvalign.live.cluster.lifecycle import Cluster, with_routers
from kvalign.live.cluster.ports import LOOPBACK, PortPool
from kvalign.live.cluster.processes import rss_bytes, run_pids
from kvalign.live.cluster.routers import RouterSetup
from kvalign.live.cluster.topology import COMPONENT, RUN_MARKER_ENV, Topology
from kvalign.live.runs.fuzz.credit_error import CreditError
from kvalign.live.runs.fuzz.dp_ranks import DpRanks, relay_subscriptions
from kvalign.live.engines.hicache import HiCache
from kvalign.live.runs.decode_half import TransferProbe
from kvalign.live.runs.fuzz.transfers import FuzzTransfers
from kvalign.live.runs.fuzz.invariants import (
    InvariantFailed, Observation, Tally, evaluate, failure_numbers, lost_pages_reused,
    observation_json,
)
from kvalign.live.runs.fuzz.prompts import Sent, new_tokens, resolve
from kvalign.live.runs.fuzz.publisher_faults import HARMFUL, PublisherFaultControl
from kvalign.live.runs.fuzz.recorded import record_engine_stream, engine_cause
from kvalign.live.runs.fuzz.speculation import DEFAULT_SIZE as SPEC_WINDOW, Judged, Member, SpecWindows
from kvalign.live.runs.fuzz.stores import cached_tokens_after, stored_page_range, stored_pages, stores_seen
from kvalign.live.runs.fuzz.surfaces import MetricReader, SurfaceMissing, applied_units
from kvalign.live.runs.fuzz.views import DeliveredViews, WorkerViews, common_blocks
from kvalign.live.runs.fuzz import hicache as tiers_check
from kvalign.live.runs.fuzz import hicache_rules
from kvalign.live.runs.fuzz.tiers import TierDeliveredViews, TierWorkerViews
from kvalign.live.wire.client import Completion, SseError, complete_tokens
from kvalign.live.wire.lossy_hop import LossyHop

ENGINES = ("sglang-cpu", "fake-cpu", "sglang-gpu", "vllm-cpu")
TOPOLOGIES = ("agg", "disagg")
FLUSH_SEEDS = 2**40  # the flush rule's prompts: clear of every other rule's seeds, so no worker shares their pages
#: The first SGLang release with ``KVEventsConfig.format`` ("dynamo"), read in the 0.5.21 and 0.5.23 wheels.
DYNAMO_FORMAT_SINCE = (0, 5, 23)
DECODE_POOL_TOKENS = 4096  # the decode worker's pool in disaggregation (see SglangCpuWorkerKind)
#: How often the run's peak memory is sampled (after a step): a walk of /proc over every process of the
#: run cost ~5 ms, 8% of a request, and the engines' memory grows over minutes, not milliseconds.
RSS_EVERY_S = 1.0
COUNTS = ("evictions", "flushes", "dropped_batches", "restarts", "concurrent_requests", "evicted_requeried",
          "flushed_requeried", "lost_requeried", "lost_batches_diagnosed")


class FuzzEnvironmentError(RuntimeError):
    """The cluster could not do what a step needs (start, flush, answer): exit 2, not a finding."""


@dataclass(frozen=True)
class FuzzOptions:
    """What a fuzz run launches and how it checks."""

    engine: str = "sglang-cpu"
    topology: Literal["agg", "disagg"] = "agg"
    workers: int = 2  # aggregated workers, or prefill workers in disaggregation (plus one decode)
    page_size: int = 16
    max_total_tokens: int = 512  # small, so a few long prompts make the scheduler evict
    sglang: str | None = None  # an SGLang release from the wheel cache; None: the environment's
    draft: Literal["agree", "disagree"] = "agree"  # disagree: decode speculation's negative control
    router_eagle: bool = True
    gap_check: bool = True  # False: predict the router from the engine's stream (negative control)
    strip_salt: bool = False  # the hop removes cache_salt from stored blocks (negative control)
    hide_gaps: bool = False  # the hop renumbers batches after a loss, hiding the gap from every subscriber
    event_format: str = "default"  # SGLang's KV-event format ("dynamo": --kv-events-config format, SGLang 0.5.23+)
    publisher_faults: bool = False  # the workers load kvalign's publisher-fault hook (a test control; scripts arm it)
    quiet_s: float = 0.4
    settle_timeout_s: float = 8.0
    restart_grace_s: float = 2.0
    fill_prompts: int = 4
    startup_timeout_s: float = 600.0
    routers: int = 1  # dynamo.frontend replicas (kvalign.live.runs.fuzz.replicas)
    replica_sync: bool = True  # False: router1 runs without --router-replica-sync (routers_agree's control)
    router_mode: Literal["events", "approx"] = "events"  # approx: --no-router-kv-events, measured not judged
    approx_policy: Literal["ttl", "lru"] = "ttl"
    router_ttl: float | None = None
    hicache: HiCache | None = None  # SGLang's host tier on the publishing workers (the HiCache rules run)
    dp_size: int = 1  # SGLang's --dp-size of each aggregated worker: one source per rank (.dp_ranks)
    rank0_only: bool = False  # negative control: every rank but 0 is silent at its hop (only rank 0 publishes)
    dp_attention: bool = False  # the ranks are attention-DP groups of one TP group, not replicas
    spec_window: int = SPEC_WINDOW  # requests per decode_keeps_speculating judgment on one decode worker (.speculation)
    transfer: str | None = None  # disagg: SGLang's prefill->decode backend (None: the release's; fake: kv_transferred's control)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.topology not in TOPOLOGIES:
            raise ValueError(f"--topology must be one of {', '.join(TOPOLOGIES)}, got {self.topology!r}")
        if self.workers < 1 or self.workers * self.dp_size < 2:
            raise ValueError(f"the fuzz needs at least 2 workers or data-parallel ranks (routing has a choice), got "
                             f"{self.workers} worker(s) x {self.dp_size} rank(s)")
        if self.dp_size > 1 and (self.topology == "disagg" or self.hicache is not None or self.routers > 1
                                 or self.publisher_faults):
            raise ValueError("--dp-size runs aggregated workers behind one router, without --hicache or publisher faults")
        if self.dp_attention and self.dp_size < 2:
            raise ValueError("--dp-attention needs --dp-size 2 or more")
        if self.rank0_only and self.dp_size < 2:
            raise ValueError("--only-rank0-publishes needs --dp-size 2 or more")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.transfer is not None and (self.topology != "disagg" or self.transfer not in ("nixl", "fake")):
            raise ValueError(f"--transfer nixl|fake picks the prefill->decode backend of --topology disagg, got "
                             f"{self.transfer!r} on {self.topology}")
        if self.spec_window < 1:
            raise ValueError(f"--spec-window must be >= 1, got {self.spec_window}")
        if self.draft not in ("agree", "disagree"):
            raise ValueError(f"--draft must be agree or disagree, got {self.draft!r}")
        if self.event_format not in ("default", "dynamo"):
            raise ValueError(f"--event-format must be default or dynamo, got {self.event_format!r}")
        if not self.replica_sync and self.routers < 2:
            raise ValueError("--no-replica-sync needs --routers 2 or more (it starts the second router without sync)")
        if self.routers > 1 and self.router_mode == "approx":
            raise ValueError("--routers 2+ with --router-mode approx: an approximate router's prediction has no live "
                             "reference to hold replicas to here; run `kvalign live up --routers 2 --router-mode approx "
                             "--scenario`, which holds them to the routing decisions")
        self.router_setup()

    def router_setup(self) -> RouterSetup:
        """The frontends this run starts (:mod:`kvalign.live.cluster.routers`)."""
        return RouterSetup(self.routers, self.router_mode, frozenset() if self.replica_sync else frozenset({1}),
                           self.approx_policy, self.router_ttl)

    def as_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "topology": self.topology, "workers": self.workers,
                "page_size": self.page_size, "max_total_tokens": self.max_total_tokens, "sglang": self.sglang,
                "draft": self.draft, "router_eagle": self.router_eagle, "gap_check": self.gap_check,
                "strip_salt": self.strip_salt, "hide_gaps": self.hide_gaps, "routers": self.routers,
                "replica_sync": self.replica_sync, "router_mode": self.router_mode, "approx_policy": self.approx_policy,
                "router_ttl": self.router_ttl, **({"publisher_faults": True} if self.publisher_faults else {}),
                "hicache": None if self.hicache is None else {"write_policy": self.hicache.write_policy,
                                                              "ratio": self.hicache.ratio,
                                                              **({"storage": self.hicache.storage}
                                                                 if self.hicache.storage else {})},
                "event_format": self.event_format, "spec_window": self.spec_window,
                **({"transfer": self.transfer} if self.transfer else {}),
                **({"dp_size": self.dp_size} if self.dp_size > 1 else {}),
                **({"dp_attention": True} if self.dp_attention else {}),
                **({"rank0_only": True} if self.rank0_only else {})}


def engine_problem(opts: FuzzOptions) -> str | None:
    """Why ``opts.engine`` cannot run the fuzz on this machine (None when it can)."""
    if opts.hicache is not None and opts.hicache.storage is not None and (opts.engine != "sglang-cpu"
                                                                         or opts.topology != "agg"):
        return ("--storage runs on --engine sglang-cpu with aggregated workers (the storage refill is judged on the "
                "worker's own reuse report)")
    if opts.engine == "sglang-gpu":
        if opts.sglang is not None or opts.dp_size > 1 or opts.publisher_faults or opts.event_format != "default":
            return ("--engine sglang-gpu runs the bundled SGLang with one rank per worker and SGLang's own publisher: "
                    "--sglang, --dp-size, publisher faults and --event-format dynamo run on --engine sglang-cpu")
        from kvalign.live.engines.sglang_gpu import engine_problem as gpu_problem

        return gpu_problem()
    if opts.engine == "vllm-cpu":
        from kvalign.live.engines.vllm_cpu import fuzz_problem

        return fuzz_problem(opts)
    if opts.engine == "fake-cpu":
        return ("--engine fake-cpu has no engine reuse report (cached_tokens) and no "
                "speculative decoder; the fuzz needs the real engine: run --engine sglang-cpu")
    from kvalign.live.engines.sglang_cpu import engine_problem as cpu_problem

    problem = cpu_problem(opts.sglang)
    if problem is None and opts.event_format == "dynamo":
        from kvalign.verify.matrix import installed

        version = opts.sglang or installed("sglang") or ""
        if tuple(int(x) for x in version.split(".")[:3] if x.isdigit()) < DYNAMO_FORMAT_SINCE:
            return (f"SGLang {version} has no \"dynamo\" KV-event format (--kv-events-config format arrived in "
                    f"{'.'.join(map(str, DYNAMO_FORMAT_SINCE))})")
    return problem


def fuzz_topology(opts: FuzzOptions) -> Topology:
    if opts.engine == "vllm-cpu":  # plain-keyed blocks, no speculative decoder
        return Topology.aggregated(opts.workers, eagle=False, page_size=opts.page_size)
    register = None if opts.router_eagle else False
    if opts.topology == "disagg":
        return Topology.disaggregated(opts.workers, 1, eagle=True, register_eagle=register, page_size=opts.page_size)
    return Topology.aggregated(opts.workers, eagle=True, register_eagle=register, page_size=opts.page_size,
                               dp_size=opts.dp_size, dp_attention=opts.dp_attention)


def _hop_ports(plan: Any, labels: list[str], *, taken: list[int] = (), what: str = "hop") -> dict[str, int]:
    """A loopback port per worker for one of the hop's PUBs, distinct from every plan port."""
    pool = PortPool()
    taken = [*taken, *plan.all_ports()]
    pool.assigned.update({f"plan.{i}": p for i, p in enumerate(taken) if p is not None})
    return {label: pool.take(f"{label}.{what}") for label in labels}


@contextlib.contextmanager
def fuzz_cluster(opts: FuzzOptions, run_dir: str | Path) -> Iterator[tuple[Cluster, LossyHop]]:
    """The real workers, frontend, router and lossy hop; torn down on exit.

    Aggregated workers cache their own generated tokens and publish them, so a follow-up reuses
    them; prefill workers do not (they never decode), which a follow-up on ``disagg`` checks live.
    """
    topo = fuzz_topology(opts)
    if opts.engine == "sglang-gpu":
        from kvalign.live.engines import sglang_gpu

        plan, kind = sglang_gpu.plan_cluster(topo, run_dir, draft=opts.draft, hicache=opts.hicache,
                                             transfer=opts.transfer or "nixl")
    elif opts.engine == "vllm-cpu":
        from kvalign.live.engines import vllm_cpu

        plan, kind = vllm_cpu.plan_cluster(topo, run_dir)
    else:
        from kvalign.live.engines import sglang_cpu

        plan, kind = sglang_cpu.plan_cluster(topo, run_dir, draft=opts.draft, sglang_version=opts.sglang,
                                             hicache=opts.hicache, transfer=opts.transfer)
    plan = with_routers(plan, opts.router_setup())
    sources = ranks.sources(plan)  # one per publishing worker, or per rank of a data-parallel one
    labels = list(sources)
    downstream = _hop_ports(plan, labels)
    taps = _hop_ports(plan, labels, taken=list(downstream.values()), what="tap")
    kind.max_total_tokens = opts.max_total_tokens  # the publishing workers': small, so they evict
    kind.relay_subscribe = relay_subscriptions(plan, downstream)
    if opts.engine != "vllm-cpu":  # SGLang's own settings
        kind.decode_max_total_tokens = DECODE_POOL_TOKENS
        kind.event_format, kind.record_server_info = opts.event_format, True
    if opts.publisher_faults:
        kind.publisher_faults_dir = Path(run_dir) / "publisher-faults"
    upstream = {label: plan.kv_events_connect(w, rank) for label, (w, rank) in sources.items()}
    with LossyHop(upstream, downstream, strip_salt=opts.strip_salt, hide_gaps=opts.hide_gaps, taps=taps) as hop:
        if opts.rank0_only:
            hop.silenced = {label for label, (_w, rank) in sources.items() if rank != 0}
        cluster = Cluster(plan, kind, startup_timeout_s=opts.startup_timeout_s, router_view=hop.downstream,
                          engine_view=hop.taps)
        with cluster:
            yield cluster, hop


@dataclass
class FuzzDriver:
    """Runs steps on a live fuzz cluster and checks each answered request."""

    cluster: Cluster
    hop: LossyHop
    opts: FuzzOptions
    progress: Callable[[str], None] = lambda _msg: None
    tally: Tally = field(default_factory=Tally)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    requests: int = 0
    examples: int = 0
    steps_run: int = 0
    unsettled: int = 0
    peak_rss_bytes: int = 0  # every process of the run, sampled after a step at most every RSS_EVERY_S
    replicas: Any = None  # FuzzReplicas with --routers 2+ (set in __post_init__)
    credit_error: CreditError | None = None  # router tokens minus engine tokens, per request (a measurement)
    dp: DpRanks | None = None  # the per-rank checks and figures with --dp-size (set in __post_init__)

    def __post_init__(self) -> None:
        b = self.opts.page_size
        views, delivered = (TierWorkerViews, TierDeliveredViews) if self.opts.hicache else (WorkerViews, DeliveredViews)
        self.engine_views = views(self.cluster.capture, b)
        self.router_views = views(self.cluster.router_capture, b)
        self.delivered_views = delivered(self.engine_views, self.router_views, self.hop.original_seq)
        self.disagg = self.opts.topology == "disagg"
        plan = self.cluster.plan
        decode = [w.name for w in plan.topology.workers if w.role in ("decode", "agg")]
        self.metrics = MetricReader(self.cluster.frontend_url, {
            name: f"http://{LOOPBACK}:{plan.worker_ports[name].system}/metrics" for name in decode})
        #: HiCache (``--hicache``): SGLang's per-tier reuse on each publishing worker, the router's host weight
        self.engine_tiers = tiers_check.EngineTiers({
            name: f"http://{LOOPBACK}:{plan.worker_ports[name].system}/metrics" for name in self.labels
        }) if self.opts.hicache else None
        self.host_weight = tiers_check.host_weight() if self.opts.hicache else 0.0
        self.router_credit = tiers_check.RouterCredit(self.metrics.frontend_url)
        self.speculation = SpecWindows(self.metrics, self.tally, self.opts.spec_window, self._judged)
        #: the workers run a speculative decoder (``decode_keeps_speculating`` applies): not vLLM's
        self.speculates = self.opts.engine != "vllm-cpu"
        #: disaggregation: each alone-sent request's hand-off to decode (``kv_transferred``)
        backend = getattr(self.cluster.kind, "transfer_backend", None)
        self.transfers = FuzzTransfers(TransferProbe.of(plan, backend), self.tally) if self.disagg and backend else None
        self.example_failed = False  # a step raised: the example's open speculation windows are not judged
        self._rss_at = float("-inf")  # when peak_rss_bytes was last sampled
        self.host_requeries: list[dict[str, Any]] = []
        self.host_evictions_in_example = self.storage_refills_in_example = 0
        self.storage_refills: list[dict[str, Any]] = []  # each request SGLang served partly from storage
        if self.opts.hicache:
            self.counts.update(dict.fromkeys(hicache_rules.COUNTS, 0))
        if self.opts.hicache and self.opts.hicache.storage:
            self.counts.update(dict.fromkeys(tiers_check.STORAGE_COUNTS, 0))
        self.history: list[Sent] = []
        self.served: list[str | None] = []  # the worker each history prompt ran on
        self.steps: list[dict[str, Any]] = []
        self.observed: list[dict[str, Any]] = []
        self.restarts_in_example = 0
        self.notes: list[str] = []  # what the run saw that no invariant judges (a loss diagnose did not name)
        faults_dir = getattr(self.cluster.kind, "publisher_faults_dir", None)
        self.publisher_faults = None if faults_dir is None else PublisherFaultControl(faults_dir)
        self.faults_fired: list[dict[str, Any]] = []  # each armed publisher fault: request, worker, what it did
        self._corrupted: set[str] = set()  # workers whose stream a harmful publisher fault broke this example
        self._settled_at: tuple[int, int] | None = None  # capture counts when a request's stores were last seen settled
        # per worker: batches the router-side capture joined too late to see (ZMQ's slow joiner), taken
        # once the cluster is quiet: quiet alone first (an unreachable baseline), then what it lacks
        self._lag_base: dict[str, int] = dict.fromkeys(self.labels, 1 << 30)
        self._applied_base: float | None = None  # router-applied minus router-side events, once quiet
        self.credit_error = CreditError(b)
        self.dp = DpRanks(self) if self.opts.dp_size > 1 else None
        if self.opts.routers > 1:
            from kvalign.live.runs.fuzz.replicas import FuzzReplicas

            self.replicas = FuzzReplicas(self)
        self._settle()
        self._lag_base = {}
        self._lag_base = {lab: max(v, 0) for lab, v in self._behind().items()}
        self._rebase_applied()

    # ---- helpers --------------------------------------------------------------------------

    @property
    def labels(self) -> list[str]:
        """The workers the router routes prefill to (and whose events it indexes): one per rank of a
        data-parallel worker (:mod:`kvalign.live.cluster.ranks`)."""
        return list(ranks.sources(self.cluster.plan))

    def _handle(self, label: str) -> Any:
        """The worker (its handle) a source label belongs to."""
        return self.cluster.workers[ranks.split_label(label)[0]]

    @property
    def prediction_views(self) -> WorkerViews | DeliveredViews:
        """The engine's batches the hop delivered; all of them with the gap check off."""
        return self.delivered_views if self.opts.gap_check else self.engine_views

    def engine_eagle(self, label: str) -> bool:
        return self._handle(label).spec.eagle

    def decode_label(self, label: str) -> str:
        return next(n for n, h in self.cluster.workers.items() if h.spec.role == "decode") if self.disagg else \
            ranks.split_label(label)[0]

    def _behind(self) -> dict[str, int]:
        """Per worker, engine batches the router side has not received yet (beyond the batches the
        hop lost on purpose, and beyond the example's baseline)."""
        lost = self.hop.lost_downstream
        return {lab: self.cluster.capture.count(lab) - self.cluster.router_capture.count(lab) - lost.get(lab, 0)
                - self._lag_base.get(lab, 0) for lab in self.labels}

    def _components(self) -> list[str]:
        return sorted({COMPONENT[self._handle(lab).spec.role] for lab in self.labels})

    def _delivered_events(self) -> int:
        """KV events the router side received from the publishing workers (what the relay got), in the
        frontend's ``kv_cache_events_applied`` unit (:func:`.surfaces.applied_units`)."""
        labels = set(self.labels)
        return sum(applied_units(c.batch.events) for c in self.cluster.router_capture.snapshot() if c.label in labels)

    def _applied_behind(self) -> float:
        """Events the relay received that the router's index has not applied yet (0 without the counter)."""
        if self.replicas is not None and self.replicas.event_plane_down:
            return 0.0
        delivered = self._delivered_events()
        others = 0.0 if self.replicas is None else self.replicas.applied_behind(delivered, self._components())
        if self._applied_base is None:
            return others
        applied = self.metrics.events_applied(self._components())
        return max(others, 0.0 if applied is None else delivered - (applied - self._applied_base))

    def _rebase_applied(self) -> None:
        """Count from now: what the router applied before (an earlier user of the cluster, batches the
        capture joined too late for) or will never apply (a restarted worker's relay) is not waited on."""
        if self.opts.router_mode == "approx":  # the router consumes no KV events: nothing to wait for
            return
        applied = self.metrics.events_applied(self._components())
        self._applied_base = None if applied is None else applied - self._delivered_events()
        if self.replicas is not None:
            self.replicas.rebase_applied(self._delivered_events(), self._components())

    def _settle(self, *, after_request: bool = False) -> bool:
        """Wait until the router side has every batch the engine published (but those the hop lost
        on purpose) and no capture received a batch for ``quiet_s`` (bounded). After a request the
        quiet time counts from now (its events may not be out yet); before one it counts from the
        latest batch's arrival, so a cluster that the previous step already settled costs no wait.
        Quiet alone is not enough on a loaded machine: the router side (Dynamo's relay, and kvalign's
        capture of it) was seen half a second behind the engine's stream after a flush, and the
        router's index behind its relay (a CI run: credit 0 for 3 pages the relay had, the replay
        credited them), so it also waits until the frontend's index applied every event the relay
        received (:meth:`MetricReader.events_applied`). A shortfall still there at the bound is
        counted as unsettled and not waited on again."""
        caps = (self.cluster.capture, self.cluster.router_capture)
        if not after_request and self._settled_at == tuple(c.count() for c in caps):
            return True  # the last request settled on its stores being seen, and nothing arrived since
        deadline = time.monotonic() + self.opts.settle_timeout_s
        arrivals = [t for t in (c.last_received() for c in caps) if t is not None]
        since = time.monotonic() if after_request else max(arrivals, default=0.0)
        last = tuple(c.count() for c in caps)
        while time.monotonic() < deadline:
            now = tuple(c.count() for c in caps)
            if now != last:
                last, since = now, time.monotonic()
            elif (time.monotonic() - since >= self.opts.quiet_s and all(v <= 0 for v in self._behind().values())
                  and self._applied_behind() <= 0):
                return True
            time.sleep(0.02)
        self._unsettled(f"still not quiet after {self.opts.settle_timeout_s:g}s (behind {self._behind()})")
        return False

    def _unsettled(self, why: str) -> None:
        """A settle that reached its bound: counted, and an applied-events shortfall not waited on again."""
        self.unsettled += 1
        self.progress(f"settle: {why}; counted in unsettled_waits")
        behind = self._applied_behind()
        if behind > 0:
            self.notes.append(f"the router's index had applied {behind:g} fewer KV events than its "
                              f"relay received after {self.opts.settle_timeout_s:g}s; counted from there")
            self._rebase_applied()

    def _settle_stores(self, label: str, prompt: list[int], output: list[int], mark: int, salt: str | None,
                       answered: float) -> bool:
        """After an answer: wait (bounded) until ``label``'s own stream shows every page the request
        stored (:mod:`.stores`: held at the routing ``mark`` or stored since) and the router side has
        caught up with it (every batch, and the frontend's index has applied every event), with no
        quiet window. Where SGLang may or may not have stored one more page (the last generated
        token's KV), and the prompt's own stores already account for the rest, that page is waited
        for until ``quiet_s`` after the answer.

        Waiting on the stores themselves is what a quiet window only guessed at: a prefill worker
        publishes its stores when the request is done on *its* side, which on a loaded machine came
        more than 0.4 s after the decode worker's answer, so the next request found pages the engine
        held and neither view had yet (the engine reused 288 tokens that kvalign's engine view said
        were not there). A batch that comes after this point anyway (an eviction published late)
        makes the next request's settle wait for quiet again."""
        b, eagle, decodes = self.opts.page_size, self.engine_eagle(label), not self.disagg
        cached = cached_tokens_after(prompt, output, decodes=decodes)
        lo, hi = stored_page_range(len(prompt), len(output), b, eagle=eagle, decodes=decodes)
        maybe_more = hi > lo and lo <= stored_pages(len(prompt), b, eagle=eagle)  # no finish batch was needed for lo
        held = self._held(self.engine_views, label, cached, mark, salt=salt)[0]
        since = mark - self.engine_views.epoch.get(label, 0)
        deadline = time.monotonic() + self.opts.settle_timeout_s
        while True:
            seen = stores_seen(self.engine_views.since_epoch(label), since, cached, held, b, eagle=eagle, namespace=salt)
            enough = seen >= hi or (seen >= lo and (not maybe_more or time.monotonic() - answered >= self.opts.quiet_s))
            if enough and all(v <= 0 for v in self._behind().values()) and self._applied_behind() <= 0:
                self._settled_at = (self.cluster.capture.count(), self.cluster.router_capture.count())
                return True
            if time.monotonic() > deadline:
                self._unsettled(f"{label}'s stream shows {seen} of the {lo} pages the request stored after "
                                f"{self.opts.settle_timeout_s:g}s (router side behind {self._behind()})")
                return False
            time.sleep(0.01)

    def _label_of(self, c: Completion) -> str | None:
        """The source the router chose: the worker ``prefill_worker_id`` names, at ``prefill_dp_rank``."""
        name = next((n for n, h in self.cluster.workers.items() if h.instance_id == c.prefill_worker_id), None)
        if name is None:
            return None
        n = self.cluster.plan.worker_ports[name].kv_ranks
        return ranks.source_label(name, c.prefill_dp_rank or 0, n) if n > 1 else name

    def _send(self, tokens: list[int], max_tokens: int, pin: str | None = None, salt: str | None = None) -> Completion:
        """``pin``: the source label the request must run on (a worker, and its rank when it has several)."""
        instance = None if pin is None else self._handle(pin).instance_id
        pins: dict[str, Any] = {"prefill_pin": instance} if self.disagg else {"pin": instance}
        if pin is not None and ranks.split_label(pin)[1] is not None:
            pins["dp_rank"] = ranks.split_label(pin)[1]
        try:
            url = self.cluster.frontend_url if self.replicas is None else self.replicas.next_url()
            return complete_tokens(url, self.cluster.model, tokens, max_tokens=max_tokens, cache_salt=salt, **pins)
        except (SseError, OSError) as exc:
            raise FuzzEnvironmentError(f"request of {len(tokens)} tokens failed: {exc}") from None

    def _held(self, views: WorkerViews | DeliveredViews, label: str, tokens: list[int], lo: int, hi: int | None = None,
              salt: str | None = None) -> list[int]:
        return views.held(label, tokens, eagle=self.engine_eagle(label), lo=lo, hi=hi, namespace=salt)

    def _marks(self) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """(prediction, delivered, engine) marks now."""
        return self.prediction_views.marks(), self.delivered_views.marks(), self.engine_views.marks()

    def _best(self, tokens: list[int], marks: dict[str, int], salt: str | None) -> str | None:
        held = {lab: self._held(self.prediction_views, lab, tokens, marks[lab], salt=salt)[0] for lab in self.labels}
        if self.opts.hicache:  # the router weighs a host block by its host_cache_hit_weight
            held = {lab: tiers_check.weighted(self.prediction_views.residency(
                lab, tokens, eagle=self.engine_eagle(lab), lo=marks[lab], namespace=salt)[0], self.host_weight)
                for lab in self.labels}
        top = max(held.values(), default=0)
        leaders = [lab for lab, h in held.items() if h == top]
        return leaders[0] if top > 0 and len(leaders) == 1 else None

    def _observation(self, tokens: list[int], c: Completion, label: str | None, marks: tuple, *, concurrent: bool,
                     engine_tokens: int | None, surface: str, best: str | None = None,
                     salt: str | None = None) -> Observation:
        pred_m, deliv_m, eng_m = marks
        predicted = engine_held = 0
        faulted = False
        if label is not None:
            predicted = self._held(self.prediction_views, label, tokens, pred_m[label], salt=salt)[0]
            engine_held = self._held(self.engine_views, label, tokens, eng_m[label], salt=salt)[0]
            delivered = self._held(self.delivered_views, label, tokens, deliv_m[label], salt=salt)[0]
            faulted = delivered != engine_held and any(d.label == label for d in self.hop.dropped)
        self.requests += 1
        kind = tiers_check.TierObservation if self.opts.hicache else Observation
        return kind(self.requests, tokens, c, label, concurrent, self.opts.page_size,
                           self.engine_eagle(label) if label else True, predicted, engine_held, engine_tokens,
                           surface, faulted, best, engine_mark=eng_m.get(label, 0) if label else 0, salt=salt,
                           engine_marks=dict(eng_m), vllm=self.opts.engine == "vllm-cpu")

    def _record(self, obs: Observation) -> None:
        self.history.append(Sent(tuple(obs.tokens), tuple(obs.completion.completion_token_ids)))
        self.served.append(obs.label)
        self.observed.append(observation_json(obs))

    def _check(self, obs: Observation) -> None:
        if self.credit_error is not None:
            self.credit_error.add(obs.router_tokens, obs.engine_tokens, hop_faulted=obs.hop_faulted)
        router_judged = self.opts.router_mode == "events"
        credit_before = (self.tally.checked["router_credits_engine_reuse"], self.tally.failed["router_credits_engine_reuse"])
        failures = evaluate(obs, self.tally, router_judged=router_judged)
        if self.dp is not None:
            failures = self.dp.judge(obs, failures, credit_before)
        if isinstance(obs, tiers_check.TierObservation):
            if router_judged:
                failures += tiers_check.evaluate_tiers(obs, self.tally)
                failures.sort(key=lambda f: tiers_check.EVALUATION_ORDER.index(f[0]))
            hicache_rules.record(self, obs)
        if failures:
            name, detail = failures[0]
            names = [n for n, _ in failures]
            hicache_cause = tiers_check.cause(obs)
            rank_cause = None if self.dp is None else self.dp.cause(obs)
            cause, evidence = (hicache_cause or rank_cause, None) if hicache_cause or rank_cause else self.cause(obs, names)
            numbers = {**failure_numbers(obs), **({"rank": obs.label} if self.dp is not None else {})}
            raise InvariantFailed(name, detail, cause=cause, worker=obs.label, request=obs.request,
                                  numbers=numbers, failing=names, evidence=evidence)

    def cause(self, obs: Observation, failing: list[str]) -> tuple[str, dict[str, Any] | None]:
        """Why a request failed, and the evidence: the tenant cause when the hop delivered a stored
        block without the ``cache_salt`` the engine published it with; the engine's own events when
        the engine reused pages its stream did not hold in the prompt's chain at the routing mark
        (:func:`.recorded.engine_cause`, from the stream recorded for the failure); else ``kvalign
        diagnose``'s cause for the prompt on the worker's router-side capture."""
        label = obs.label
        if label is not None and self._salt_lost(label):
            return Cause.TENANTS_SHARE_KEYS.name, None
        if label is not None and "engine_matches_index" in failing and obs.engine_tokens is not None:
            batches, start = self.engine_views.batches(label), self.engine_views.epoch.get(label, 0)
            if start and any(isinstance(ev, AllBlocksCleared) for ev in batches[start - 1].events):
                start -= 1  # the example's flush: the recorded stream starts with the clear, as a cache that was emptied
            path = record_engine_stream(Path(self.cluster.plan.run_dir) / "failures", obs.request, batches[start:],
                                        obs.tokens)
            found = engine_cause(path, obs.tokens, obs.engine_tokens, self.opts.page_size, eagle=obs.engine_eagle,
                                 routed_at=obs.engine_mark - start, salt=obs.salt)
            if found is not None:
                return found
        d = self.diagnose(label, obs.tokens)
        return ("none" if d is None or d.cause is None else d.cause.name), None

    def _salt_lost(self, label: str) -> bool:
        def salts(views: WorkerViews) -> dict[int | None, list[str | None]]:
            return {self.hop.original_seq(label, b.seq): [e.cache_salt for e in b.events if isinstance(e, BlockStored)]
                    for b in views.since_epoch(label)}

        engine, router = salts(self.engine_views), salts(self.router_views)
        return any(engine.get(seq) not in (None, got) for seq, got in router.items())

    def diagnose(self, label: str | None, tokens: list[int]) -> Any:
        from kvalign.streams.diagnose import RouterSettings, diagnose

        if label is None:
            return None
        path = self.cluster.router_capture.capture_path(label)
        if path is None or not Path(path).exists():
            return None
        eagle = "on" if self._handle(label).enable_eagle else "off"
        try:
            return diagnose(path, tokens, RouterSettings(block_size=self.opts.page_size, eagle=eagle))
        except Exception:  # noqa: BLE001 - a failure report must still come out, without a cause
            return None

    # ---- examples and steps ---------------------------------------------------------------

    def begin_example(self) -> None:
        """Flush every worker instead of restarting the cluster, and start a fresh model."""
        self.hop.disarm()
        self._settle()
        self._clear(self.labels)
        for views in (self.engine_views, self.router_views):
            for label in self.labels:
                views.start_epoch(label)
        self.history, self.served, self.steps, self.observed = [], [], [], []
        if self.example_failed or self.speculation.open:  # its windows, and counters its unjudged requests moved
            self.speculation.discard()
        self.example_failed = False
        self.restarts_in_example = self.host_evictions_in_example = self.storage_refills_in_example = 0
        self.hop.dropped.clear()
        self._corrupted.clear()
        self.examples += 1
        if self.credit_error is not None:
            self.credit_error.begin_workload()
        if self.replicas is not None:
            self.replicas.begin_example()

    def _clear(self, labels: list[str]) -> None:
        self._settled_at = None
        before = {lab: self.engine_views.mark(lab) for lab in labels}
        groups: dict[str, list[int]] = {}
        for lab in labels:
            ids = groups.setdefault(COMPONENT[self._handle(lab).spec.role], [])
            if self._handle(lab).instance_id not in ids:  # a data-parallel worker's ranks are flushed at once
                ids.append(self._handle(lab).instance_id)
        try:
            for component, ids in groups.items():
                clear_kv_blocks(self.cluster.plan, component, ids)
        except ControlError as exc:
            raise FuzzEnvironmentError(str(exc)) from None
        answering = [lab for lab in labels if lab not in self.hop.silenced]  # a silenced rank's clear reaches no one
        if self.opts.engine == "vllm-cpu":
            self._step_vllm(answering)
        if not self.cluster.capture.wait_for(
                lambda _snap: all(self.engine_views.mark(lab) > before[lab] for lab in answering), self.opts.settle_timeout_s):
            raise FuzzEnvironmentError(f"no AllBlocksCleared from {answering} after clear_kv_blocks")
        self._settle()

    def _step_vllm(self, labels: list[str]) -> None:
        """vLLM queues its ``AllBlocksCleared`` (``block_pool.py:863``) and publishes queued events only
        after a model step (``Scheduler.update_from_output``, ``scheduler.py:2371-2385``): an idle
        worker publishes a reset with its next request. A one-token request pinned to each cleared
        worker (two tokens with its answer: no whole block to store) makes that step now. Until then
        the router still credits the cleared blocks (kvalign's views, which wait for the event, too)."""
        for lab in labels:
            self._send(new_tokens(FLUSH_SEEDS - 1, 1), 1, pin=lab)

    def run_step(self, step: dict[str, Any]) -> None:
        """Run one step (recorded first, so a failing step is in the replay script)."""
        with self._failing_example():
            if step["rule"] != "request":
                self._settled_at = None  # anything but a request may publish what no request waited for: quiet again
                self.speculation.close_all()  # ... or move a decode worker's counters (a burst, a restart): judge first
                self.metrics.forget()
            self.steps.append(step)
            if self.credit_error is not None:
                self.credit_error.note_step(step)
            self.steps_run += 1
            self._run(step["rule"], step)
        now = time.monotonic()
        if now - self._rss_at >= RSS_EVERY_S:
            self._rss_at = now
            now_rss = rss_bytes(run_pids(RUN_MARKER_ENV, str(self.cluster.plan.run_dir)))
            self.peak_rss_bytes = max(self.peak_rss_bytes, now_rss)

    def end_example(self) -> None:
        """The example's last speculation windows judged (Hypothesis's teardown, and the end of a
        replay); nothing is judged after a step already failed."""
        if not self.example_failed:
            with self._failing_example():
                self.speculation.close_all()

    @contextlib.contextmanager
    def _failing_example(self) -> Iterator[None]:
        """Whatever raises fails the example (its open windows are dropped, not judged); a missing
        surface is an environment error."""
        try:
            yield
        except SurfaceMissing as exc:
            self.example_failed = True
            raise FuzzEnvironmentError(f"a per-request surface is missing: {exc}") from None
        except BaseException:
            self.example_failed = True
            raise

    def _judged(self, judged: Judged) -> None:
        """A speculation window's figure, into its requests' records and the progress log."""
        tpv = judged.window.tokens_per_verify
        for rec in self.observed:
            if rec["request"] in judged.requests:
                rec["tokens_per_verify"], rec["speculation_window"] = tpv, list(judged.requests)
        self.progress(f"speculation, {judged.describe()}")

    def _run(self, rule: str, step: dict[str, Any]) -> None:
        if rule == "request":
            pin = step.get("pin")
            self._request(resolve(step["prompt"], self.history), step["max_tokens"],
                          pin=None if pin is None else self.labels[pin % len(self.labels)], salt=step.get("salt"),
                          judge_routing=step.get("judge_routing", False),
                          fault=(step["publisher_fault"], step.get("fault_params")) if step.get("publisher_fault") else None)
        elif rule == "concurrent":
            self._concurrent([(resolve(p, self.history), mt) for p, mt in step["requests"]])
        elif rule == "flush":
            self._flush(self.labels[step["worker"] % len(self.labels)], step.get("seed", 0))
        elif rule == "fill":
            self._fill(step["seed"])
        elif rule == "drop_batch":
            self._drop(resolve(step["prompt"], self.history), step["max_tokens"], unpublished=step.get("unpublished", False))
        elif rule == "lose_removal":
            self._lose_removal(self.labels[step.get("worker", 0) % len(self.labels)], step["seed"],
                               lose=step.get("lose", True))
        elif rule == "restart":
            self._restart(self.labels[step["worker"] % len(self.labels)])
        elif rule in ("restart_router", "interrupt_events") and self.replicas is None:
            raise FuzzEnvironmentError(f"step {rule} needs router replicas (--routers 2 or more)")
        elif rule == "restart_router":
            try:
                self.replicas.restart_router(step.get("router", 0))
            except (TimeoutError, RuntimeError) as exc:
                raise FuzzEnvironmentError(f"router restart failed: {exc}") from None
        elif rule == "interrupt_events":
            self.replicas.interrupt_events(step.get("worker", 0), step.get("seed", 0))
        elif rule in hicache_rules.RULES and self.opts.hicache:
            hicache_rules.RULES[rule](self, step)
        else:
            raise ValueError(f"unknown step rule {rule!r}")

    def _request(self, tokens: list[int], max_tokens: int, pin: str | None = None, salt: str | None = None,
                 judge_routing: bool = False, fault: tuple[str, dict[str, Any] | None] | None = None) -> Observation:
        """One request sent alone on a settled cluster, with every surface read around it.
        ``judge_routing``: a pinned request's worker is still judged as a routing decision (the
        best-worker control: a gateway that pins against the router's cache view). ``fault``
        (scripts only): a publisher fault armed inside the pinned worker (every publishing worker
        unpinned) for this request (:mod:`.publisher_faults`)."""
        self._settle()
        marks = self._marks()
        agree = None if self.replicas is None else self.replicas.before(tokens, salt, marks[0])
        best = self._best(tokens, marks[0], salt) if pin is None or judge_routing else None
        decode = self.speculation.before_request(max_tokens) if self.speculates else None
        reused_before = self.metrics.prefill_reused(before_first_report=True) if self.disagg else 0.0
        tiers_before = self._tiers_now(required=False) if self.opts.hicache else None
        dropped_before = len(self.hop.dropped)
        armed = self._arm(fault, [pin] if pin else self.labels)
        if self.transfers is not None:
            self.transfers.before()
        c = self._send(tokens, max_tokens, pin, salt)
        answered = time.monotonic()
        label = self._label_of(c)
        harmful = armed is not None and armed[1] in HARMFUL
        if harmful and self._fired(armed, label):
            self._corrupted.add(label)
        if (label is None or any(d.unpublished for d in self.hop.dropped[dropped_before:]) or label in self._corrupted
                or label in self.hop.silenced or self.opts.hicache):
            # the stream will never show this request's stores (a loss or fault on purpose), or HiCache's
            # counters are read next and move on their own time: a quiet window
            self._settle(after_request=True)
        else:
            self._settle_stores(label, tokens, list(c.completion_token_ids), marks[2][label], salt, answered)
        if armed is not None:
            if not harmful:
                self._fired(armed, label)
            self.publisher_faults.disarm(self.labels)
        if self.disagg:
            engine_tokens: int | None = round(self.metrics.prefill_reused() - reused_before)
            surface = "frontend router_kv_worker_reused_tokens_total{phase=prefill} delta"
        else:
            engine_tokens, surface = c.cached_tokens, "usage.prompt_tokens_details.cached_tokens"
            if engine_tokens is None:
                raise FuzzEnvironmentError("the response has no usage.prompt_tokens_details.cached_tokens: the "
                                           "aggregated worker's reuse cannot be read")
        if decode is None or label is None:  # its decode worker's counters moved with no window to hold them
            self.metrics.forget(None if label is None else self.decode_label(label))
        obs = self._observation(tokens, c, label, marks, concurrent=False, engine_tokens=engine_tokens,
                                surface=surface, best=best, salt=salt)
        obs.stored_pages = 0 if label is None else self._held_now(label, tokens, salt)
        if tiers_before is not None:
            self._annotate_tiers(obs, tiers_before, marks, salt)
        self._record(obs)
        via = "" if self.replicas is None else f" via {self.replicas.last_router}"
        self.progress(f"request {obs.request}{via}: {len(tokens)} tokens -> {obs.label}, kv_hit_rate {c.kv_hit_rate} "
                      f"({obs.router_tokens} tokens credited, router view {obs.predicted} blocks), engine reused "
                      f"{engine_tokens}{' [hop fault]' if obs.hop_faulted else ''}")
        self._check(obs)
        if self.transfers is not None and label is not None:
            self.transfers.after(obs.request)
        if self.replicas is not None:
            self.replicas.after([agree], obs.request)
        if decode is not None and label is not None:
            d = self.decode_label(label)
            self.speculation.add(d, Member(obs.request, label, len(c.completion_token_ids)), decode[d])
        return obs

    def _tiers_now(self, *, required: bool) -> tuple[float, dict[str, dict[str, float] | None]]:
        """HiCache: the router's raw credit counter and each publishing worker's per-tier reuse, now."""
        assert self.engine_tiers is not None
        return self.router_credit.now(required=required), self.engine_tiers.snapshots()

    def _annotate_tiers(self, obs: Observation, before: tuple[float, dict[str, dict[str, float] | None]], marks: tuple,
                        salt: str | None) -> None:
        """Fill a HiCache request's per-tier fields: residency in both views at the routing mark, the
        router's raw credit (its counter's delta) and the engine's split (its counter's delta)."""
        assert isinstance(obs, tiers_check.TierObservation)
        raw, engine = self._tiers_now(required=True)
        obs.router_raw, obs.weight = raw - before[0], self.host_weight
        if obs.label is None:
            return
        eagle = self.engine_eagle(obs.label)
        obs.residency = self.engine_views.residency(obs.label, obs.tokens, eagle=eagle, lo=marks[2][obs.label],
                                                    namespace=salt)[0]
        obs.router_view = self.delivered_views.residency(obs.label, obs.tokens, eagle=eagle, lo=marks[1][obs.label],
                                                         namespace=salt)[0]
        if obs.router_view != obs.residency and any(d.label == obs.label for d in self.hop.dropped):
            # the hop lost a batch of this worker's on purpose: with HiCache a device store and its host
            # copy travel in separate batches, so the router can hold every page in the other tier only
            obs.hop_faulted = True
        assert self.engine_tiers is not None
        obs.engine_split = self.engine_tiers.split(obs.label, before[1].get(obs.label), engine.get(obs.label),
                                                   obs.engine_tokens)
        if self.opts.hicache is not None and self.opts.hicache.storage:
            obs.storage = self.engine_tiers.storage(obs.label, before[1].get(obs.label), engine.get(obs.label),
                                                    obs.engine_tokens)

    def _arm(self, fault: tuple[str, dict[str, Any] | None] | None, labels: list[str]) -> tuple[int, str] | None:
        """Arm a script's publisher fault on ``labels``: (its id, its name)."""
        if fault is None:
            return None
        if self.publisher_faults is None:
            raise FuzzEnvironmentError("the script arms a publisher fault, but the workers were started without the "
                                       "publisher-fault hook (the fuzz option publisher_faults)")
        name, params = fault
        try:
            return self.publisher_faults.arm(labels, name, params), name
        except ValueError as exc:
            raise FuzzEnvironmentError(str(exc)) from None

    def _fired(self, armed: tuple[int, str] | None, label: str | None) -> bool:
        """Whether the armed fault fired in ``label``'s worker, waiting (bounded) for the worker's
        acknowledgement, which follows the batch it changed; recorded in :attr:`faults_fired`."""
        if armed is None or label is None:
            return False
        fault_id, name = armed
        deadline = time.monotonic() + self.opts.settle_timeout_s
        done = self.publisher_faults.fired(label, fault_id)
        while done is None and time.monotonic() < deadline:
            time.sleep(0.05)
            done = self.publisher_faults.fired(label, fault_id)
        self.faults_fired.append({"request": self.requests + 1, "worker": label, "fault": name,
                                  **({"fired": False} if done is None else {"fired": True, **{
                                      k: v for k, v in done.items() if k not in ("id", "fault")}})})
        self.progress(f"publisher fault {name} on {label}: " + ("did not fire" if done is None else
                      f"{done['batches_in']} batch(es) in, {done['batches_out']} out, {done['blocks']} blocks"))
        return done is not None

    def _concurrent(self, reqs: list[tuple[list[int], int]]) -> None:
        """A burst, judged against the state settled before it. A request whose credit a sibling
        could change — the sibling shares a page of its prompt that neither view held before the
        burst, or the burst evicted a page it held — is counted ``unattributable``, not judged."""
        if self.disagg or self.opts.hicache:
            raise FuzzEnvironmentError("bursts cannot be checked in disaggregation or with HiCache: the prefill "
                                       "worker's reuse and the router's raw credit per tier are read per request "
                                       "from counters, which a burst merges")
        self._settle()
        marks = self._marks()
        agree = [] if self.replicas is None else [self.replicas.before(toks, None, marks[0]) for toks, _ in reqs]
        with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
            futures = [pool.submit(self._send, toks, mt) for toks, mt in reqs]
            answers = [f.result() for f in futures]
        self._settle(after_request=True)
        end = self._marks()
        self.counts["concurrent_requests"] += len(reqs)
        shown, checks = [], []
        for i, ((toks, _), c) in enumerate(zip(reqs, answers)):
            label = self._label_of(c)
            obs = self._observation(toks, c, label, marks, concurrent=True, engine_tokens=c.cached_tokens,
                                    surface="usage.prompt_tokens_details.cached_tokens")
            self._record(obs)
            siblings = [t for j, (t, _) in enumerate(reqs) if j != i]
            if label is not None and not self._attributable(label, toks, siblings, obs, marks, end):
                self.tally.unattributable += 1
                shown.append(f"{len(toks)} tokens -> {label} (kv_hit_rate {c.kv_hit_rate}, unattributable)")
                continue
            shown.append(f"{len(toks)} tokens -> {label} (kv_hit_rate {c.kv_hit_rate}, reused {c.cached_tokens})")
            checks.append(obs)
        self.progress(f"concurrent burst of {len(reqs)}: " + ", ".join(shown))
        for obs in checks:
            self._check(obs)
        if self.replicas is not None:
            self.replicas.after(agree, self.requests)

    def _attributable(self, label: str, tokens: list[int], siblings: list[list[int]], obs: Observation,
                      start: tuple, end: tuple) -> bool:
        eagle = self.engine_eagle(label)
        settled = min(obs.predicted, obs.engine_held)
        if any(common_blocks(tokens, s, self.opts.page_size, eagle=eagle) > settled for s in siblings):
            return False
        for views, lo, hi, before in ((self.engine_views, start[2], end[2], obs.engine_held),
                                      (self.prediction_views, start[0], end[0], obs.predicted)):
            if min(self._held(views, label, tokens, lo[label], hi[label])) < before:
                return False  # the burst evicted a page the request could have been credited with
        return True

    def _held_now(self, label: str, tokens: list[int], salt: str | None = None) -> int:
        """The engine view's leading pages of ``tokens`` on ``label`` now."""
        return self._held(self.engine_views, label, tokens, self.engine_views.mark(label), salt=salt)[0]

    def _fill(self, seed: int) -> None:
        """Long fresh prompts on one worker until its pool has had to evict, then the first of them
        again: its pages were evicted, so router and engine must both say so (pinned, because the
        router would spread fresh prompts over the workers and no pool would fill)."""
        label = self.labels[seed % len(self.labels)]
        length = min(self.opts.max_total_tokens * 3 // 5, 300)
        self.progress(f"fill: {self.opts.fill_prompts} fresh prompts of {length} tokens on {label}, then the first again")
        first = [self._request(new_tokens(seed * 1000 + i, length), 1, pin=label)
                 for i in range(self.opts.fill_prompts)][0]
        self._requery(first, "evicted_requeried", "fill")

    def _requery(self, obs: Observation, counter: str, why: str) -> None:
        """Re-send ``obs``'s prompt pinned to the worker that served it; counted in ``counter`` when
        the engine has since dropped pages it stored for it (the check then looks at them)."""
        if obs.label is None:
            return
        again = self._request(obs.tokens, 1, pin=obs.label)
        if again.engine_held < obs.stored_pages:
            self.counts[counter] += 1
            self.progress(f"{why}: request {again.request} re-queried {obs.label} after {obs.stored_pages - again.engine_held} "
                          f"of the prompt's {obs.stored_pages} pages were dropped")

    def _flush(self, label: str, seed: int) -> None:
        """Store a fresh prompt on ``label`` (pinned), send it again unpinned — ``label`` alone holds
        it, so the router must choose it (a ``best_worker_chosen`` check every flush gives, whatever
        the live tie-breaks did before) — then flush ``label`` and re-query the prompt on it."""
        tokens = new_tokens(FLUSH_SEEDS + seed, 3 * self.opts.page_size + 1)
        self._request(tokens, 1, pin=label)
        self._request(tokens, 1)
        held = self._held_now(label, tokens)
        self.progress(f"flush {label} (it held {held} pages of the prompt re-queried next)")
        self._clear([label])
        self.counts["flushes"] += 1
        again = self._request(tokens, 1, pin=label)
        if held > 0:
            self.counts["flushed_requeried"] += 1
            self.progress(f"flush: request {again.request} re-queried {held} flushed pages on {label}")

    def _drop(self, tokens: list[int], max_tokens: int, *, unpublished: bool = False) -> None:
        """Lose the request's store batch on the hop, then make the loss observable: a follow-up
        pinned to the same worker stores pages under the lost ones (orphans to the router), which
        is the evidence ``kvalign diagnose`` needs to name the gap. ``unpublished`` (scripts only):
        kvalign's engine view loses it too, as if SGLang's publisher never sent it."""
        dropped_before = len(self.hop.dropped)
        self.hop.drop_next_store_batch(unpublished=unpublished)
        obs = self._request(tokens, max_tokens)
        self.hop.disarm()
        lost = self.hop.dropped[dropped_before:]
        if not lost:
            self.progress("drop_batch: the request's stores shared a batch with removals (or stored nothing new); "
                          "no batch lost")
            return
        self.counts["dropped_batches"] += len(lost)
        label = lost[0].label
        self.progress(f"drop_batch: the hop lost {label}'s batch seq {lost[0].seq} ({lost[0].blocks} blocks) "
                      f"of request {obs.request}")
        follow = [*tokens, *self.history[-1].output, *new_tokens(len(tokens), self.opts.page_size + 1)]
        again = self._request(follow, 1, pin=label)
        if lost_pages_reused(obs, again):
            self.counts["lost_requeried"] += 1
        else:
            self.progress(f"drop_batch: follow-up request {again.request} did not reuse the lost pages "
                          f"{obs.engine_held}..{obs.stored_pages - 1} (engine view {again.engine_held} pages, reused "
                          f"{again.engine_tokens} tokens): not counted in lost_requeried")
        d = self.diagnose(label, follow)
        cause = "none" if d is None or d.cause is None else d.cause.name
        self.progress(f"drop_batch: kvalign diagnose on {label}'s router-side capture: {cause}")
        if cause == "SEQUENCE_GAP":
            self.counts["lost_batches_diagnosed"] += 1
        else:
            self.notes.append(f"the hop lost {label}'s batch seq {lost[0].seq} of request {obs.request}, but kvalign "
                              f"diagnose names {cause}" + ("" if d is None else f" ({d.detail})"))

    def _lose_removal(self, label: str, seed: int, *, lose: bool) -> None:
        """A prompt on ``label``, then a flush of ``label`` with the hop armed to lose its next batch
        of pure removals (the flush's ``AllBlocksCleared``: SGLang publishes evictions together with
        the stores that caused them, never alone), then the prompt again on ``label``. The router
        still holds the cleared pages, so its credit on them is stale (``lose=False``: the twin)."""
        first = self._request(new_tokens(seed, 100), 1, pin=label)
        dropped_before = len(self.hop.dropped)
        if lose:
            self.hop.drop_next_removal_batch(label)
        self._clear([label])
        self.hop.disarm()
        lost = self.hop.dropped[dropped_before:]
        self.counts["dropped_batches"] += len(lost)
        self.counts["flushes"] += 1
        self.progress(f"lose_removal: flushed {label}; the hop lost {len(lost)} removal batch(es)"
                      + "".join(f" (seq {d.seq})" for d in lost))
        if lose and not lost:
            raise FuzzEnvironmentError(f"the hop saw no batch of pure removals from {label} after its flush")
        self._requery(first, "flushed_requeried", "lose_removal")

    def _restart(self, source: str) -> None:
        label = ranks.split_label(source)[0]  # a data-parallel worker restarts with all its ranks
        old = self.cluster.workers[label].instance_id
        self.progress(f"restart {label} (instance {old})")
        t0 = time.monotonic()
        try:
            new = self.cluster.restart_worker(label, timeout_s=self.opts.startup_timeout_s)
        except (TimeoutError, RuntimeError) as exc:
            raise FuzzEnvironmentError(f"restart of {label} failed: {exc}") from None
        time.sleep(self.opts.restart_grace_s)  # the frontend's discovery watch sees both changes
        self._settled_at = None  # a new worker's stream: settle on quiet again
        self._rebase_applied()  # what the new relay published before the router subscribed is never applied
        self._settle()
        restarted = [lab for lab in self.labels if ranks.split_label(lab)[0] == label]
        for views in (self.engine_views, self.router_views):
            for lab in restarted:
                views.start_epoch(lab)
        self.hop.dropped[:] = [d for d in self.hop.dropped if d.label not in restarted]
        self._corrupted.difference_update(restarted)
        self.restarts_in_example += 1
        self.counts["restarts"] += 1
        self.progress(f"restart {label}: new instance {new.instance_id} after {time.monotonic() - t0:.0f}s")

    def finish_counts(self) -> dict[str, int]:
        """The counts, with evictions read off the engine's own stream (pages removed)."""
        removed = sum(1 for c in self.cluster.capture.snapshot() for ev in c.batch.events if isinstance(ev, BlockRemoved))
        tiered = tiers_check.tier_counts({lab: self.engine_views.batches(lab) for lab in self.labels},
                                         self.opts.page_size) if self.opts.hicache else {}
        by_rank = {} if self.dp is None else {"requests_by_rank": self.dp.figures.requests_by_rank()}
        return {**self.counts, "evictions": removed, **tiered, **by_rank}

    def invariants_json(self) -> dict[str, Any]:
        """Each invariant's checked / failed counts (with the per-rank split on data-parallel workers)."""
        return self.tally.as_json() if self.dp is None else self.dp.invariants_json(self.tally.as_json())
