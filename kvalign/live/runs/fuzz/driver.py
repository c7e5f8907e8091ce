"""The fuzz cluster and the steps a generated (or replayed) workload runs on it.

:func:`fuzz_cluster` starts real workers behind the real frontend and KV router, each worker's
KV events passing through a :class:`~kvalign.live.wire.lossy_hop.LossyHop` on their way to Dynamo's
relay, with kvalign capturing both sides of the hop. :class:`FuzzDriver` runs one JSON-able step
at a time — the Hypothesis machine and ``--replay`` call the same code — and checks every answered
request (:mod:`.invariants`) before the next step.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvalign.causes import Cause
from kvalign.events import BlockRemoved, BlockStored
from kvalign.live.wire.client import Completion, SseError, complete_tokens
from kvalign.live.cluster.lifecycle import Cluster
from kvalign.live.cluster.control import ControlError, clear_kv_blocks
from kvalign.live.runs.fuzz.invariants import InvariantFailed, Observation, Tally, evaluate, observation_json
from kvalign.live.runs.fuzz.prompts import Sent, new_tokens, resolve
from kvalign.live.runs.fuzz.views import DeliveredViews, WorkerViews
from kvalign.live.wire.lossy_hop import LossyHop
from kvalign.live.cluster.ports import PortPool
from kvalign.live.cluster.processes import rss_bytes, run_pids
from kvalign.live.cluster.topology import COMPONENT, RUN_MARKER_ENV, Topology

ENGINES = ("sglang-cpu", "fake-cpu", "sglang-gpu")
COUNTS = ("evictions", "flushes", "dropped_batches", "restarts", "concurrent_requests")


class FuzzEnvironmentError(RuntimeError):
    """The cluster could not do what a step needs (start, flush, answer): exit 2, not a finding."""


@dataclass(frozen=True)
class FuzzOptions:
    """What a fuzz run launches and how it checks."""

    engine: str = "sglang-cpu"
    workers: int = 2
    page_size: int = 16
    max_total_tokens: int = 512  # small, so a few long prompts make the scheduler evict
    router_eagle: bool = True
    gap_check: bool = True  # False: predict the router from the engine's stream (negative control)
    strip_salt: bool = False  # the hop removes cache_salt from stored blocks (negative control)
    quiet_s: float = 0.4
    settle_timeout_s: float = 8.0
    restart_grace_s: float = 2.0
    fill_prompts: int = 4
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.workers < 2:
            raise ValueError(f"the fuzz needs at least 2 workers (routing has a choice), got {self.workers}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")

    def as_json(self) -> dict[str, Any]:
        return {"engine": self.engine, "workers": self.workers, "page_size": self.page_size,
                "max_total_tokens": self.max_total_tokens, "router_eagle": self.router_eagle,
                "gap_check": self.gap_check, "strip_salt": self.strip_salt}


def engine_problem(opts: FuzzOptions) -> str | None:
    """Why ``opts.engine`` cannot run the fuzz on this machine (None when it can)."""
    if opts.engine == "sglang-gpu":
        return ("the fuzz on --engine sglang-gpu needs the GPU worker kind in aggregated mode with a lossy hop, "
                "which the gpu_2 nightly does not provide yet; run --engine sglang-cpu")
    if opts.engine == "fake-cpu":
        return ("--engine fake-cpu has no engine reuse report (cached_tokens), no clear_kv_blocks endpoint and no "
                "speculative decoder; the fuzz needs the real engine: run --engine sglang-cpu")
    from kvalign.live.engines.sglang_cpu import engine_problem as cpu_problem

    return cpu_problem()


def _hop_ports(plan: Any, labels: list[str]) -> dict[str, int]:
    """A loopback port per worker for the hop's downstream PUB, distinct from every plan port."""
    pool = PortPool()
    taken = [plan.http_port, plan.broker_xsub, plan.broker_xpub, plan.etcd_client, plan.etcd_peer, plan.nats_port,
             *(p for wp in plan.worker_ports.values() for p in (wp.rpc, wp.kv_events, wp.system, wp.bootstrap))]
    pool.assigned.update({f"plan.{i}": p for i, p in enumerate(taken) if p is not None})
    return {label: pool.take(f"{label}.hop") for label in labels}


@contextlib.contextmanager
def fuzz_cluster(opts: FuzzOptions, run_dir: str | Path) -> Iterator[tuple[Cluster, LossyHop]]:
    """The real workers (aggregated EAGLE3), frontend, router and lossy hop; torn down on exit.

    Aggregated, not disaggregated: only a worker that both prefills and decodes caches its own
    generated tokens and publishes them, and follow-ups are meant to reuse them.
    """
    from kvalign.live.engines.sglang_cpu import plan_cluster

    topo = Topology.aggregated(opts.workers, eagle=True, register_eagle=None if opts.router_eagle else False,
                               page_size=opts.page_size)
    plan, kind = plan_cluster(topo, run_dir)
    labels = [w.name for w in topo.workers]
    downstream = _hop_ports(plan, labels)
    kind.max_total_tokens = opts.max_total_tokens
    kind.relay_subscribe = {label: f"tcp://127.0.0.1:{port}" for label, port in downstream.items()}
    upstream = {w.name: plan.kv_events_connect(w) for w in topo.workers}
    with LossyHop(upstream, downstream, strip_salt=opts.strip_salt) as hop:
        cluster = Cluster(plan, kind, startup_timeout_s=opts.startup_timeout_s, router_view=hop.downstream)
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
    peak_rss_bytes: int = 0  # every process of the run, sampled after each step

    def __post_init__(self) -> None:
        b = self.opts.page_size
        self.engine_views = WorkerViews(self.cluster.capture, b)
        self.router_views = WorkerViews(self.cluster.router_capture, b)
        self.history: list[Sent] = []
        self.steps: list[dict[str, Any]] = []
        self.observed: list[dict[str, Any]] = []
        self.retired: set[int] = set()
        self.restarted: set[str] = set()
        self.restarts_in_example = 0

    # ---- helpers --------------------------------------------------------------------------

    @property
    def labels(self) -> list[str]:
        return list(self.cluster.workers)

    @property
    def prediction_views(self) -> WorkerViews | DeliveredViews:
        """The engine's batches the hop delivered; all of them with the gap check off."""
        return DeliveredViews(self.engine_views, self.router_views) if self.opts.gap_check else self.engine_views

    def engine_eagle(self, label: str) -> bool:
        return self.cluster.workers[label].spec.eagle

    def _settle(self) -> bool:
        """Wait until no capture received a batch for ``quiet_s`` (bounded)."""
        caps = (self.cluster.capture, self.cluster.router_capture)
        deadline = time.monotonic() + self.opts.settle_timeout_s
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            now = tuple(c.count() for c in caps)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= self.opts.quiet_s:
                return True
            time.sleep(0.02)
        self.unsettled += 1
        return False

    def _label_of(self, instance_id: int | None) -> str | None:
        return next((n for n, h in self.cluster.workers.items() if h.instance_id == instance_id), None)

    def _send(self, tokens: list[int], max_tokens: int, pin: int | None = None, salt: str | None = None) -> Completion:
        try:
            return complete_tokens(self.cluster.frontend_url, self.cluster.model, tokens, max_tokens=max_tokens, pin=pin,
                                   cache_salt=salt)
        except (SseError, OSError) as exc:
            raise FuzzEnvironmentError(f"request of {len(tokens)} tokens failed: {exc}") from None

    def _best(self, tokens: list[int], marks: dict[str, int], salt: str | None) -> str | None:
        held = {lab: self.prediction_views.held(lab, tokens, eagle=self.engine_eagle(lab), lo=marks[lab],
                                                namespace=salt)[0]
                for lab in self.labels}
        top = max(held.values(), default=0)
        leaders = [lab for lab, h in held.items() if h == top]
        return leaders[0] if top > 0 and len(leaders) == 1 else None

    def _observe(self, tokens: list[int], c: Completion, *, concurrent: bool, pred_lo: dict[str, int],
                 eng_lo: dict[str, int], pred_hi: dict[str, int] | None, eng_hi: dict[str, int] | None,
                 best: str | None, salt: str | None = None) -> Observation:
        self.requests += 1
        label = self._label_of(c.prefill_worker_id)
        predicted = engine_held = [0]
        if label is not None:
            eagle = self.engine_eagle(label)
            predicted = self.prediction_views.held(label, tokens, eagle=eagle, lo=pred_lo[label],
                                                   hi=None if pred_hi is None else pred_hi[label], namespace=salt)
            engine_held = self.engine_views.held(label, tokens, eagle=eagle, lo=eng_lo[label],
                                                 hi=None if eng_hi is None else eng_hi[label], namespace=salt)
        obs = Observation(self.requests, tokens, c, label, concurrent, self.opts.page_size,
                          self.engine_eagle(label) if label else True, predicted, engine_held, best,
                          frozenset(self.retired), label in self.restarted)
        self.history.append(Sent(tuple(tokens), tuple(c.completion_token_ids)))
        self.observed.append(observation_json(obs))
        return obs

    def _check(self, obs: Observation) -> None:
        failures = evaluate(obs, self.tally)
        if failures:
            name, detail = failures[0]
            raise InvariantFailed(name, detail, cause=self.cause(obs.label, obs.tokens), worker=obs.label,
                                  request=obs.request)

    def cause(self, label: str | None, tokens: list[int]) -> str:
        """Why the router's view differs: the tenant cause when the hop delivered a stored block
        without the ``cache_salt`` the engine published it with; else ``kvalign diagnose``'s cause
        for ``tokens`` on ``label``'s router-side capture."""
        if label is not None and self._salt_lost(label):
            return Cause.TENANTS_SHARE_KEYS.name
        d = self.diagnose(label, tokens)
        return "none" if d is None or d.cause is None else d.cause.name

    def _salt_lost(self, label: str) -> bool:
        def salts(views: WorkerViews) -> dict[int | None, list[str | None]]:
            return {b.seq: [e.cache_salt for e in b.events if isinstance(e, BlockStored)] for b in views.since_epoch(label)}

        engine, router = salts(self.engine_views), salts(self.router_views)
        return any(engine.get(seq) not in (None, got) for seq, got in router.items())

    def diagnose(self, label: str | None, tokens: list[int]) -> Any:
        from kvalign.diagnose import RouterSettings, diagnose

        if label is None:
            return None
        path = self.cluster.router_capture.capture_path(label)
        if path is None or not Path(path).exists():
            return None
        eagle = "on" if self.cluster.workers[label].enable_eagle else "off"
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
        self.history, self.steps, self.observed = [], [], []
        self.retired, self.restarted, self.restarts_in_example = set(), set(), 0
        self.examples += 1

    def _clear(self, labels: list[str]) -> None:
        before = {lab: self.engine_views.mark(lab) for lab in labels}
        groups: dict[str, list[int]] = {}
        for lab in labels:
            groups.setdefault(COMPONENT[self.cluster.workers[lab].spec.role], []).append(self.cluster.workers[lab].instance_id)
        try:
            for component, ids in groups.items():
                clear_kv_blocks(self.cluster.plan, component, ids)
        except ControlError as exc:
            raise FuzzEnvironmentError(str(exc)) from None
        if not self.cluster.capture.wait_for(
                lambda _snap: all(self.engine_views.mark(lab) > before[lab] for lab in labels), self.opts.settle_timeout_s):
            raise FuzzEnvironmentError(f"no AllBlocksCleared from {labels} after clear_kv_blocks")
        self._settle()

    def run_step(self, step: dict[str, Any]) -> None:
        """Run one step (recorded first, so a failing step is in the replay script)."""
        self.steps.append(step)
        self.steps_run += 1
        rule = step["rule"]
        if rule == "request":
            pin = step.get("pin")
            self._request(resolve(step["prompt"], self.history), step["max_tokens"],
                          pin=None if pin is None else self.labels[pin % len(self.labels)], salt=step.get("salt"))
        elif rule == "concurrent":
            self._concurrent([(resolve(p, self.history), mt) for p, mt in step["requests"]])
        elif rule == "flush":
            label = self.labels[step["worker"] % len(self.labels)]
            self.progress(f"flush {label}")
            self._clear([label])
            self.counts["flushes"] += 1
        elif rule == "fill":
            self._fill(step["seed"])
        elif rule == "drop_batch":
            self._drop(resolve(step["prompt"], self.history), step["max_tokens"])
        elif rule == "restart":
            self._restart(self.labels[step["worker"] % len(self.labels)])
        else:
            raise ValueError(f"unknown step rule {rule!r}")
        self.peak_rss_bytes = max(self.peak_rss_bytes, rss_bytes(run_pids(RUN_MARKER_ENV, str(self.cluster.plan.run_dir))))

    def _request(self, tokens: list[int], max_tokens: int, pin: str | None = None,
                 salt: str | None = None) -> Observation:
        self._settle()
        pred_lo, eng_lo = self.prediction_views.marks(), self.engine_views.marks()
        best = None if pin else self._best(tokens, pred_lo, salt)
        c = self._send(tokens, max_tokens, None if pin is None else self.cluster.workers[pin].instance_id, salt)
        self._settle()
        obs = self._observe(tokens, c, concurrent=False, pred_lo=pred_lo, eng_lo=eng_lo, pred_hi=None, eng_hi=None,
                            best=best, salt=salt)
        self.progress(f"request {obs.request}: {len(tokens)} tokens -> {obs.label}, kv_hit_rate {c.kv_hit_rate} "
                      f"(kvalign {obs.predicted[0]} blocks), cached_tokens {c.cached_tokens}")
        self._check(obs)
        return obs

    def _concurrent(self, reqs: list[tuple[list[int], int]]) -> None:
        self._settle()
        pred_lo, eng_lo = self.prediction_views.marks(), self.engine_views.marks()
        with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
            futures = [pool.submit(self._send, toks, mt) for toks, mt in reqs]
            answers = [f.result() for f in futures]
        self._settle()
        pred_hi, eng_hi = self.prediction_views.marks(), self.engine_views.marks()
        self.counts["concurrent_requests"] += len(reqs)
        observations = [self._observe(toks, c, concurrent=True, pred_lo=pred_lo, eng_lo=eng_lo, pred_hi=pred_hi,
                                      eng_hi=eng_hi, best=None) for (toks, _), c in zip(reqs, answers)]
        self.progress(f"concurrent burst of {len(reqs)}: " + ", ".join(
            f"{len(o.tokens)} tokens -> {o.label} (kv_hit_rate {o.completion.kv_hit_rate})" for o in observations))
        for obs in observations:
            self._check(obs)

    def _fill(self, seed: int) -> None:
        """Long fresh prompts until every worker's pool has had to evict (or ``fill_prompts`` sent)."""
        length = min(self.opts.max_total_tokens * 3 // 5, 300)
        self.progress(f"fill: {self.opts.fill_prompts} fresh prompts of {length} tokens")
        for i in range(self.opts.fill_prompts):
            self._request(new_tokens(seed * 1000 + i, length), 1)

    def _drop(self, tokens: list[int], max_tokens: int) -> None:
        """Lose the request's store batch on the hop, then make the loss observable: a follow-up
        pinned to the same worker stores pages under the lost ones (orphans to the router), which
        is the evidence ``kvalign diagnose`` needs to name the gap."""
        dropped_before = len(self.hop.dropped)
        self.hop.drop_next_store_batch()
        obs = self._request(tokens, max_tokens)
        self.hop.disarm()
        lost = self.hop.dropped[dropped_before:]
        if not lost:
            self.progress("drop_batch: the request stored nothing new; no batch lost")
            return
        self.counts["dropped_batches"] += len(lost)
        label = lost[0].label
        self.progress(f"drop_batch: the hop lost {label}'s batch seq {lost[0].seq} ({lost[0].blocks} blocks) "
                      f"of request {obs.request}")
        follow = [*tokens, *self.history[-1].output, *new_tokens(len(tokens), self.opts.page_size + 1)]
        self._request(follow, 1, pin=label)
        d = self.diagnose(label, follow)
        cause = "none" if d is None or d.cause is None else d.cause.name
        self.tally.checked["gap_diagnosed"] += 1
        self.progress(f"drop_batch: kvalign diagnose on {label}'s capture: {cause}")
        if cause != "SEQUENCE_GAP":
            self.tally.failed["gap_diagnosed"] += 1
            raise InvariantFailed("gap_diagnosed", f"the hop lost {label}'s batch seq {lost[0].seq} of request "
                                  f"{obs.request}, but kvalign diagnose on its capture names {cause}"
                                  + ("" if d is None else f" ({d.detail})"), cause=cause, worker=label,
                                  request=obs.request)

    def _restart(self, label: str) -> None:
        old = self.cluster.workers[label].instance_id
        self.progress(f"restart {label} (instance {old})")
        t0 = time.monotonic()
        try:
            new = self.cluster.restart_worker(label, timeout_s=self.opts.startup_timeout_s)
        except (TimeoutError, RuntimeError) as exc:
            raise FuzzEnvironmentError(f"restart of {label} failed: {exc}") from None
        time.sleep(self.opts.restart_grace_s)  # the frontend's discovery watch sees both changes
        self._settle()
        for views in (self.engine_views, self.router_views):
            views.start_epoch(label)
        self.retired.add(old)
        self.restarted.add(label)
        self.restarts_in_example += 1
        self.counts["restarts"] += 1
        self.progress(f"restart {label}: new instance {new.instance_id} after {time.monotonic() - t0:.0f}s")

    def finish_counts(self) -> dict[str, int]:
        """The counts, with evictions read off the engine's own stream (pages removed)."""
        removed = sum(1 for c in self.cluster.capture.snapshot() for ev in c.batch.events if isinstance(ev, BlockRemoved))
        return {**self.counts, "evictions": removed}
