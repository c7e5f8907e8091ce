"""The router-replica scenario of ``kvalign live up --routers N --scenario``: replicas kept equal.

Fresh prompts, each pinned to one worker and sent through the replicas in turn, then the two
faults Dynamo's own replica test applies (``tests/router``: a second router joining late, the event
plane stopped and started again), each followed by a bounded wait for the replicas to converge:

1. ``store``: prompt P_i through router ``i mod R``, pinned to worker ``i mod W``. After it, every
   replica applied its three lifecycle events, and every replica would route every prompt stored
   so far to the worker holding it (``routers_agree``, :mod:`.replica_check`);
2. ``restart``: the last replica's frontend stopped and started again: it must know every stored
   prompt again within ``bound_s`` (Dynamo 1.6.1 rebuilds a new router's prefix state from the
   workers' local indexers);
3. ``interrupt``: the event plane's process stopped, one more prompt stored (its KV events and
   its lifecycle events reach no router), the event plane started again and a prompt stored on the
   same worker (its events show the router the gap): every replica must know the lost prompt
   within ``bound_s`` (the routers recover the gap from the worker's local indexer).

The reference a replica is held to: in events mode kvalign's own index of the workers' KV events
(the engine's truth); in approximate mode the routing decisions themselves (which worker each
prompt was sent to: what an approximate router records, and what its replicas would know if
replica sync carried it). Works with fake CPU workers (seconds) and the real CPU engine alike.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvalign.model.hashing import block_hashes
from kvalign.live.runs.replica_check import RouterReplicas, judge_choices, judge_lifecycle
from kvalign.live.wire.client import complete_tokens

#: Token ids of the scenario's prompts: inside every live model's vocabulary (the fake workers'
#: word-level tokenizer has 69 ids, the tiny Llama 512), clear of the special tokens.
TOKEN_RANGE = (3, 60)


def fresh_prompt(seed: int, blocks: int, page: int) -> list[int]:
    """``blocks`` full pages under EAGLE and plain keys alike (``blocks * page + 1`` tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(*TOKEN_RANGE) for _ in range(blocks * page + 1)]


@dataclass
class ReplicaStep:
    """One step of the scenario and what every replica said after it."""

    step: int
    action: str
    router: str | None
    worker: str | None
    choices: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # prompt -> replica -> workers named
    lifecycle: dict[str, float] = field(default_factory=dict)  # replica -> lifecycle events applied for the step
    converge_s: float | None = None
    failure: str | None = None

    def row(self) -> str:
        said = "; ".join(f"{p}: " + " ".join(f"{r}={'/'.join(ws)}" for r, ws in rs.items()) for p, rs in self.choices.items())
        life = " ".join(f"{r}+{v:g}" for r, v in self.lifecycle.items())
        conv = "" if self.converge_s is None else f" converged in {self.converge_s:.1f}s"
        return (f"{self.step:>2} {self.action:<9} {self.router or '-':<8} {self.worker or '-':<9} "
                f"lifecycle[{life}]{conv} {said}")


@dataclass
class ReplicaReport:
    """The scenario's steps, and its first ``routers_agree`` failure (None: the replicas agreed)."""

    mode: str
    steps: list[ReplicaStep] = field(default_factory=list)
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None

    def as_json(self) -> dict[str, Any]:
        return {"verdict": "pass" if self.passed else "fail", "router_mode": self.mode,
                "failure": None if self.failure is None else {"invariant": "routers_agree", "detail": self.failure},
                "steps": [{"step": s.step, "action": s.action, "router": s.router, "worker": s.worker,
                           "choices": s.choices, "lifecycle": s.lifecycle, "converge_s": s.converge_s,
                           "failure": s.failure} for s in self.steps]}

    def render(self) -> str:
        lines = [s.row() for s in self.steps]
        lines.append("PASS: routers_agree held after every step" if self.passed else f"FAIL routers_agree: {self.failure}")
        return "\n".join(lines)


class ReplicaScenario:
    """Runs the steps on a live cluster with at least two router replicas."""

    def __init__(self, cluster: Any, *, bound_s: float = 30.0, lifecycle_bound_s: float = 5.0,
                 progress: Callable[[str], None] = lambda _m: None) -> None:
        self.cluster, self.bound_s, self.lifecycle_bound_s, self.progress = cluster, bound_s, lifecycle_bound_s, progress
        plan = cluster.plan
        self.page = plan.topology.page_size
        self.mode = plan.routers.mode
        self.synced = plan.routers.replicated and any(plan.routers.synced(i) for i in range(plan.routers.count))
        self.replicas = RouterReplicas(plan.frontend_urls, cluster.model)
        self.publishing = {n: h for n, h in cluster.workers.items() if h.kv_events_endpoint}
        self.labels = sorted(self.publishing)
        self.names = {h.instance_id: n for n, h in self.publishing.items()}
        self.disagg = plan.topology.disaggregated_mode
        self.stored: dict[str, tuple[list[int], str]] = {}  # prompt name -> (tokens, worker it was sent to)
        self.report = ReplicaReport(self.mode)
        self._life_base = self.replicas.quiet_lifecycle()

    # ---- readings ---------------------------------------------------------------------------

    def _reference(self, tokens: list[int], worker: str) -> dict[int, int]:
        """Leading blocks of ``tokens`` per worker id: kvalign's index of the workers' events, or in
        approximate mode the routing decision (the one worker it was sent to)."""
        eagle = any(h.enable_eagle for h in self.publishing.values())
        hashes = block_hashes(tokens, self.page, eagle=eagle)
        if self.mode == "approx":
            return {h.instance_id: (len(hashes) if n == worker else 0) for n, h in self.publishing.items()}
        ids = {n: h.instance_id for n, h in self.publishing.items()}
        held = self.cluster.capture.index(ids, self.page).overlap(hashes)
        return {i: held.get(i, 0) for i in ids.values()}

    def _named(self, choices: dict[str, frozenset[int]]) -> dict[str, list[str]]:
        return {r: sorted(self.names.get(w, str(w)) for w in ws) for r, ws in choices.items()}

    # ---- steps ------------------------------------------------------------------------------

    def _send(self, name: str, router: int, worker: str, seed: int) -> None:
        tokens = fresh_prompt(seed, 3, self.page)
        pin = self.publishing[worker].instance_id
        url = self.cluster.plan.frontend_urls[router]
        before = self.cluster.capture.count(worker)
        complete_tokens(url, self.cluster.model, tokens, max_tokens=2,
                        **({"prefill_pin": pin} if self.disagg else {"pin": pin}))
        self.cluster.capture.wait_for(lambda snap: sum(c.label == worker for c in snap) > before, self.lifecycle_bound_s)
        self.stored[name] = (tokens, worker)

    def _agree(self, step: ReplicaStep, bound_s: float) -> None:
        """Every stored prompt, every replica, judged against the reference (waiting up to
        ``bound_s`` for the replicas to converge: 0 on an ordinary step)."""
        worst = 0.0
        for pname, (tokens, worker) in self.stored.items():
            held = self._reference(tokens, worker)
            got, waited = self.replicas.await_agreement(tokens, held, bound_s)
            worst = max(worst, waited)
            step.choices[pname] = self._named(got)
            verdict = judge_choices(got, held, self.names)
            if verdict is not None and step.failure is None:
                step.failure = f"step {step.step} ({step.action}), prompt {pname}: {verdict}" + (
                    f" (still after {bound_s:g}s)" if bound_s else "")
        if bound_s:
            step.converge_s = round(worst, 2)

    def _lifecycle(self, step: ReplicaStep, requests: int, *, judged: bool = True) -> None:
        if not self.cluster.plan.routers.replicated:
            return
        deltas = self.replicas.await_lifecycle(self._life_base, requests, self.lifecycle_bound_s if judged else 0.5)
        step.lifecycle = {r: round(d, 1) for r, d in deltas.items()}
        self._life_base = self.replicas.lifecycle()
        verdict = judge_lifecycle(deltas, requests, step.router) if judged else None
        if verdict is not None and step.failure is None:
            step.failure = f"step {step.step} ({step.action}, through {step.router}): {verdict}"

    def _finish(self, step: ReplicaStep) -> None:
        self.report.steps.append(step)
        self.progress(step.row())
        if step.failure and self.report.failure is None:
            self.report.failure = step.failure

    def stores(self, prompts: int, *, seed: int = 1000) -> ReplicaReport:
        """``prompts`` fresh prompts, each through the next replica, pinned to the next worker,
        each followed by ``routers_agree`` on every prompt stored so far."""
        n_routers, n = self.cluster.plan.routers.count, len(self.report.steps)
        for i in range(prompts):
            router, worker = (n + i) % n_routers, self.labels[(n + i) % len(self.labels)]
            step = ReplicaStep(n + i + 1, "store", f"router{router}", worker)
            self._send(f"P{n + i}", router, worker, seed=seed + n + i)
            self._lifecycle(step, 1)
            self._agree(step, 0.0)
            self._finish(step)
        return self.report

    def run(self, prompts: int = 4) -> ReplicaReport:
        """The whole scenario: :meth:`stores`, then a replica restart and an event-plane
        interruption, each waited on for convergence, then one more store."""
        self.stores(prompts)
        last = self.cluster.plan.routers.count - 1
        step = ReplicaStep(len(self.report.steps) + 1, "restart", f"router{last}", None)
        restart_s = self.cluster.restart_router(last)
        self.progress(f"router{last} restarted, serving again after {restart_s:.1f}s")
        self._life_base = self.replicas.lifecycle()  # the restarted router counts from 0
        self._agree(step, self.bound_s)
        self._finish(step)
        step = ReplicaStep(len(self.report.steps) + 1, "interrupt", "router0", self.labels[0])
        self.cluster.interrupt_event_plane()
        try:
            self._send("Plost", 0, self.labels[0], seed=2000)
        finally:
            self.cluster.resume_event_plane()
        self._lifecycle(step, 1, judged=False)  # published while the event plane was down: lost on purpose
        self._finish(step)
        step = ReplicaStep(len(self.report.steps) + 1, "resume", f"router{min(1, last)}", self.labels[0])
        self._send("Pafter", min(1, last), self.labels[0], seed=2001)
        self._agree(step, self.bound_s)
        self._lifecycle(step, 1, judged=False)  # the replicas' sync subscriptions rejoin the restarted plane
        self._finish(step)
        step = ReplicaStep(len(self.report.steps) + 1, "store", f"router{last}", self.labels[-1])
        self._send("Pend", last, self.labels[-1], seed=2002)
        self._lifecycle(step, 1)
        self._agree(step, 0.0)
        self._finish(step)
        return self.report
