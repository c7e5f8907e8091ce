"""Router replicas in the fuzz: requests spread over them, ``routers_agree`` on every request.

With ``--routers N`` the fuzz cluster runs N ``dynamo.frontend`` replicas with replica sync
(:mod:`kvalign.live.cluster.routers`), and request k of the run goes through replica ``k mod N``:
every invariant of the single-router fuzz then judges each replica on the requests it serves
(``router_matches_prediction`` holds the serving replica's credit to kvalign's router view). On top,
``routers_agree`` (:mod:`kvalign.live.runs.replica_check`) asks *every* replica about every request:

* before it is sent, on the settled state: where each replica would route it (query-only, nothing
  dispatched); each must name only workers holding the most of the prompt in kvalign's router view
  (the KV events the relays received), so with one strictly best worker every replica names it;
* after it settled: every replica took in its three active-sequence lifecycle events (what replica
  sync carries), whichever replica routed it.

Two faults are replica faults, each looked at again by a bounded convergence wait (:data:`BOUND_S`)
on the latest prompts one worker strictly holds, then by every later request:

* ``restart_router``: a replica other than router0 is stopped and started (router0 is where the
  fuzz reads the frontend's counters); it rebuilds its index from the workers' local indexers;
* ``interrupt_events``: the event plane's process is stopped, a fresh prompt is stored on a worker
  (its KV events reach no router), the event plane is started again and a second fresh prompt is
  stored on the same worker (its events show the routers the gap, which they recover from the
  worker's local indexer); then every replica must know the lost prompt.

A replica that has not converged within the bound is a ``routers_agree`` failure with every
replica's answer and kvalign's view.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

from kvalign.model.causes import Cause
from kvalign.live.runs.fuzz.invariants import InvariantFailed
from kvalign.live.runs.fuzz.prompts import new_tokens
from kvalign.live.runs.fuzz.surfaces import MetricReader
from kvalign.live.runs.replica_check import RouterReplicas, judge_choices, judge_lifecycle, top_workers

#: Seconds a replica may take to agree again after a fault (Dynamo recovers a restarted router and
#: a gap from the workers' local indexers; seen live: under a second on fake workers).
BOUND_S = 30.0
#: Seconds the lifecycle events of a request may take to reach every replica after its answer.
LIFECYCLE_BOUND_S = 5.0
INTERRUPT_SEEDS = 2**41  # the interrupt rule's fresh prompts: clear of every other rule's seeds


class FuzzReplicas:
    """The replicas of one fuzz cluster, as the driver sees them."""

    def __init__(self, driver: Any, reader: RouterReplicas | None = None) -> None:
        """``driver``: the :class:`~kvalign.live.runs.fuzz.driver.FuzzDriver` whose cluster, views and
        request loop the replica checks use; ``reader``: how the replicas are read (their HTTP
        surfaces by default)."""
        self.driver = driver
        plan = driver.cluster.plan
        self.urls = plan.frontend_urls
        self.reader = reader or RouterReplicas(self.urls, driver.cluster.model)
        self.metrics = [MetricReader(url, {}) for url in self.urls]
        self._next = itertools.count()
        self.served: dict[str, int] = dict.fromkeys(self.reader.names, 0)
        self.last_router: str | None = None
        self.checked = self.decisive = 0
        self.converge_s: dict[str, list[float]] = {"restart_router": [], "interrupt_events": []}
        self.event_plane_down = False
        self.faults_in_example = 0  # replica faults (restart_router, interrupt_events) drawn in this example
        self._applied_base: list[float | None] = [None] * len(self.urls)
        self._life = self.reader.quiet_lifecycle()

    def begin_example(self) -> None:
        self.faults_in_example = 0

    # ---- which replica serves ---------------------------------------------------------------

    def next_url(self) -> str:
        """The replica the next request goes through: request k through replica k mod N."""
        i = next(self._next) % len(self.urls)
        name = self.reader.names[i]
        self.served[name] += 1
        self.last_router = name
        return self.urls[i]

    # ---- settling: every replica's index applied what the relays received ----------------------

    def rebase_applied(self, delivered: int, components: Sequence[str]) -> None:
        for i, m in enumerate(self.metrics):
            applied = m.events_applied(components)
            self._applied_base[i] = None if applied is None else applied - delivered

    def applied_behind(self, delivered: int, components: Sequence[str]) -> float:
        """Events the relays received that the slowest replica's index has not applied yet."""
        if self.event_plane_down:
            return 0.0
        behind = 0.0
        for i, m in enumerate(self.metrics[1:], start=1):  # router0 is the driver's own reading
            base = self._applied_base[i]
            applied = None if base is None else m.events_applied(components)
            if applied is not None:
                behind = max(behind, delivered - (applied - base))
        return behind

    # ---- routers_agree -----------------------------------------------------------------------

    def _held(self, tokens: list[int], marks: dict[str, int], salt: str | None) -> dict[int, int]:
        d = self.driver
        return {d.cluster.workers[lab].instance_id: d._held(d.prediction_views, lab, tokens, marks[lab], salt=salt)[0]
                for lab in d.labels}

    def _names(self) -> dict[int, str]:
        return {h.instance_id: n for n, h in self.driver.cluster.workers.items()}

    def before(self, tokens: list[int], salt: str | None, marks: dict[str, int]) -> str | None:
        """Every replica's answer for the next prompt on the settled state, judged now; the
        verdict (None: they agree) is raised by :meth:`after`, once the request's own checks ran."""
        held = self._held(tokens, marks, salt)
        got = self.reader.choices(tokens, cache_salt=salt)
        self.checked += 1
        self.decisive += len(top_workers(held)) == 1
        return judge_choices(got, held, self._names())

    def after(self, verdicts: Sequence[str | None], request: int) -> None:
        """After ``len(verdicts)`` requests settled: the lifecycle check, then the first failure."""
        d = self.driver
        serving = self.last_router if len(verdicts) == 1 else "several replicas"
        judged = not self.event_plane_down  # lifecycle events published while it is down are lost on purpose
        deltas = self.reader.await_lifecycle(self._life, len(verdicts), LIFECYCLE_BOUND_S if judged else 0.5)
        self._life = self.reader.lifecycle()
        lifecycle = judge_lifecycle(deltas, len(verdicts), serving) if judged else None
        index = next((v for v in verdicts if v is not None), None)
        detail, cause = (index, Cause.REPLICA_INDEX_DIVERGED) if index else (lifecycle, Cause.REPLICA_STATE_UNSYNCED)
        d.tally.checked["routers_agree"] += len(verdicts)
        if detail is not None:
            d.tally.failed["routers_agree"] += 1
            raise InvariantFailed("routers_agree", f"request {request} (through {serving}): {detail}",
                                  cause=cause.name, request=request,
                                  numbers={"lifecycle_events": {r: round(v, 1) for r, v in deltas.items()}})

    # ---- faults ------------------------------------------------------------------------------

    def _probes(self, limit: int = 3) -> list[tuple[list[int], str | None, dict[int, int]]]:
        """The latest prompts of this example that one worker strictly holds in the router view."""
        d = self.driver
        marks = d.prediction_views.marks()
        out: list[tuple[list[int], str | None, dict[int, int]]] = []
        for sent in reversed(d.history):
            held = self._held(list(sent.tokens), marks, None)
            if len(top_workers(held)) == 1 and max(held.values()) > 0:
                out.append((list(sent.tokens), None, held))
            if len(out) == limit:
                break
        return out

    def converge(self, fault: str) -> None:
        """Wait (bounded) until every replica agrees with the router view on the probes; a replica
        that does not is a ``routers_agree`` failure."""
        d = self.driver
        probes = self._probes()
        if not probes:
            d.progress(f"{fault}: no prompt of this example is held by one worker alone yet; the next requests judge it")
            return
        worst = 0.0
        for tokens, salt, held in probes:
            got, waited = self.reader.await_agreement(tokens, held, BOUND_S, cache_salt=salt)
            worst = max(worst, waited)
            verdict = judge_choices(got, held, self._names())
            if verdict is not None:  # counted with the requests' checks only when it fails
                d.tally.checked["routers_agree"] += 1
                d.tally.failed["routers_agree"] += 1
                raise InvariantFailed("routers_agree", f"{BOUND_S:g}s after {fault}: {verdict}",
                                      cause=Cause.REPLICA_INDEX_DIVERGED.name)
        self.converge_s[fault].append(round(worst, 2))
        d.progress(f"{fault}: every replica agreed with kvalign's router view on {len(probes)} prompt(s) after {worst:.1f}s")

    def restart_router(self, replica: int) -> None:
        d = self.driver
        i = 1 + replica % (len(self.urls) - 1)
        self.faults_in_example += 1
        d.progress(f"restart_router: router{i}")
        d._settle()
        up = d.cluster.restart_router(i)  # a failure to start again is the driver's environment error
        d.progress(f"restart_router: router{i} serving again after {up:.1f}s")
        self._life = self.reader.lifecycle()  # its counters start from 0
        d._rebase_applied()
        self.converge("restart_router")

    def interrupt_events(self, worker: int, seed: int) -> None:
        d = self.driver
        label = d.labels[worker % len(d.labels)]
        lost = new_tokens(INTERRUPT_SEEDS + seed, 3 * d.opts.page_size + 1)
        self.faults_in_example += 1
        d._settle()
        d.progress(f"interrupt_events: event plane stopped; a fresh prompt stored on {label}")
        d.cluster.interrupt_event_plane()
        self.event_plane_down = True
        try:
            d._request(lost, 1, pin=label)
        finally:
            d.cluster.resume_event_plane()
            self.event_plane_down = False
        time.sleep(d.opts.restart_grace_s)  # subscribers reconnect to the restarted plane
        d.progress(f"interrupt_events: event plane started again; a fresh prompt on {label} shows the gap")
        self.event_plane_down = True  # the routers' applied counts now lag the relays by the lost batch
        try:
            d._request(new_tokens(INTERRUPT_SEEDS + seed + 1, 2 * d.opts.page_size + 1), 1, pin=label)
        finally:
            self.event_plane_down = False
        self.converge("interrupt_events")
        d._rebase_applied()
        self._life = self.reader.lifecycle()

    def as_json(self) -> dict[str, Any]:
        plan = self.driver.cluster.plan
        return {"count": len(self.urls), "mode": plan.routers.mode,
                "synced": [plan.routers.synced(i) for i in range(len(self.urls))],
                "requests_by_router": dict(self.served), "checked": self.checked,
                "decisive": self.decisive, "converge_s": self.converge_s}
