"""``routers_agree``: router replicas that should know the same thing, asked the same question.

Two things a Dynamo 1.6.1 router keeps, and how kvalign reads each replica's copy from stable
surfaces (never logs):

* **Which worker holds the next prompt** (prefix-cache state). Each replica is asked, query-only
  (:func:`kvalign.live.wire.route_query.route_choices`: routed, never dispatched, no state
  touched), where it would send the prompt, a few times. A replica whose index holds the prompt
  best on one worker names that worker every time; with a tie it names several. The replicas
  agree when every one of them names only workers that hold the most of the prompt in the
  reference (kvalign's router view in events mode: the KV events the relays received), so when
  one worker strictly holds the most, every replica names that one worker.
* **Which requests are in flight where** (active-sequence state, what replica sync carries). Every
  routed request produces three lifecycle events (``ActiveSequenceEventData``: ``AddRequest``,
  ``MarkPrefillCompleted``, ``Free``) on the event plane, and every synced replica applies each
  of them — its peers' and its own — counting them in
  ``dynamo_component_router_active_sequence_ingress_events_applied_total`` (measured on 1.6.1: every
  replica's counter rises by 3 per request, whichever replica routed it). A replica whose counter
  did not rise by 3 per request missed the others' in-flight requests and balances load blind to them.

The judges are pure functions of those readings (unit-tested); :class:`RouterReplicas` reads them.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvalign.live.wire.metrics import MetricsSnapshot, scrape
from kvalign.live.wire.route_query import route_choices

#: ``ActiveSequenceEventData`` has three kinds, each published once per routed request.
LIFECYCLE_EVENTS_PER_REQUEST = 3
#: The frontend's counter of active-sequence lifecycle events its router applied (own and peers').
ACTIVE_APPLIED = "router_active_sequence_ingress_events_applied_total"
#: Query-only asks per replica and prompt. A replica that breaks a two-worker tie names one worker
#: all 8 times with probability 2**-7, so a replica whose index lost a prompt is caught with
#: probability 127/128 per check (a tie is judged against the reference's tied set, never against
#: another replica's answer, so a tie in the reference is never a false failure).
ASKS = 8
#: Consecutive agreeing rounds that count as converged after a fault: polling a tied replica until
#: it happens to name the right worker would otherwise always "converge" (3 rounds of 8: 2**-21).
CONVERGED_ROUNDS = 3


def lifecycle_applied(snap: MetricsSnapshot) -> float:
    """Active-sequence lifecycle events a frontend's router applied (0 when it exports none: a
    router without replica sync never subscribes to them)."""
    return float(sum(s.value for s in snap.samples if s.name.removesuffix("_total").endswith(ACTIVE_APPLIED.removesuffix("_total"))))


def top_workers(held: Mapping[int, int]) -> frozenset[int]:
    """The workers holding the most leading blocks of a prompt (every worker when none holds any)."""
    best = max(held.values(), default=0)
    return frozenset(w for w, h in held.items() if h == best)


def judge_choices(choices: Mapping[str, frozenset[int]], held: Mapping[int, int],
                  names: Mapping[int, str] | None = None) -> str | None:
    """None when every replica named only workers holding the most of the prompt in ``held`` (the
    reference: worker id -> leading blocks); else what each replica named, against the reference."""
    top = top_workers(held)
    wrong = {r: c for r, c in choices.items() if not c <= top}
    if not wrong:
        return None
    label = (lambda w: names.get(w, str(w))) if names else str
    said = ", ".join(f"{r} would route to {'/'.join(sorted(map(label, c)))}" for r, c in sorted(choices.items()))
    ref = ", ".join(f"{label(w)} {h}" for w, h in sorted(held.items(), key=lambda kv: label(kv[0])))
    return (f"{said}; the reference holds leading blocks {ref} (best: {'/'.join(sorted(map(label, top)))}), "
            f"so {', '.join(sorted(wrong))} routes by an index that differs from it")


def judge_peer_choices(choices: Mapping[str, frozenset[int]], names: Mapping[int, str] | None = None) -> str | None:
    """Without a reference (approximate mode: each router predicts from routing decisions): None
    unless a replica names one worker for sure while another names a different set."""
    sure = {r: c for r, c in choices.items() if len(c) == 1}
    if not sure or all(c == next(iter(sure.values())) for c in choices.values()):
        return None
    label = (lambda w: names.get(w, str(w))) if names else str
    return "; ".join(f"{r} would route to {'/'.join(sorted(map(label, c)))}" for r, c in sorted(choices.items()))


def judge_lifecycle(deltas: Mapping[str, float], requests: int, serving: str | None = None) -> str | None:
    """None when every replica took in the lifecycle events of all ``requests`` routed since the
    last mark (:data:`LIFECYCLE_EVENTS_PER_REQUEST` each); else who took in how many. ``serving``:
    the replica that routed them, named in the finding (a replica without replica sync publishes
    all of its own requests' events, so its peers do not learn what it has in flight)."""
    want = LIFECYCLE_EVENTS_PER_REQUEST * requests
    short = {r: d for r, d in deltas.items() if d < want}
    if not short:
        return None
    got = ", ".join(f"{r} {d:g}" for r, d in sorted(deltas.items()))
    who = f"{requests} request(s) routed by {serving}" if serving else f"{requests} request(s)"
    return (f"{who} publish {want} active-sequence lifecycle events (AddRequest, MarkPrefillCompleted, Free each); "
            f"the replicas took in {got}: {', '.join(sorted(short))} missed them, so its view of the workers' "
            "in-flight load lacks them (a replica routing without --router-replica-sync does not publish them all)")


@dataclass
class RouterReplicas:
    """Reads every router replica of a cluster: where each would route a prompt, and how many
    lifecycle events each applied."""

    urls: Sequence[str]
    model: str
    asks: int = ASKS

    @property
    def names(self) -> list[str]:
        return [f"router{i}" for i in range(len(self.urls))]

    def choices(self, tokens: Sequence[int], *, cache_salt: str | None = None) -> dict[str, frozenset[int]]:
        return {name: route_choices(url, self.model, tokens, asks=self.asks, cache_salt=cache_salt)
                for name, url in zip(self.names, self.urls)}

    def lifecycle(self) -> dict[str, float]:
        return {name: lifecycle_applied(scrape(f"{url}/metrics")) for name, url in zip(self.names, self.urls)}

    def quiet_lifecycle(self, quiet_s: float = 0.5, bound_s: float = 5.0) -> dict[str, float]:
        """The counters once none moved for ``quiet_s`` (at most ``bound_s``): a base taken right
        after start-up would otherwise miss the late lifecycle events of the readiness probes."""
        deadline = time.monotonic() + bound_s
        last, since = self.lifecycle(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.lifecycle()
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        return last

    def await_lifecycle(self, base: Mapping[str, float], requests: int, bound_s: float) -> dict[str, float]:
        """The counters' rise since ``base`` once every replica applied ``requests`` requests'
        events, or at ``bound_s`` (the events travel through the event plane after the answer)."""
        deadline = time.monotonic() + bound_s
        while True:
            deltas = {r: v - base.get(r, 0.0) for r, v in self.lifecycle().items()}
            if judge_lifecycle(deltas, requests) is None or time.monotonic() > deadline:
                return deltas
            time.sleep(0.05)

    def await_agreement(self, tokens: Sequence[int], held: Mapping[int, int] | None, bound_s: float, *,
                        cache_salt: str | None = None) -> tuple[dict[str, frozenset[int]], float]:
        """Ask every replica until they agree (against ``held``, or with each other when None) or
        ``bound_s`` passed: after a fault, how long the replicas took to converge. Returns the last
        answers and the seconds it took."""
        start = time.monotonic()
        agreed, since = 0, 0.0  # the current streak of agreeing rounds, and when it began
        while True:
            asked = time.monotonic() - start
            got = self.choices(tokens, cache_salt=cache_salt)
            verdict = judge_choices(got, held) if held is not None else judge_peer_choices(got)
            if verdict is None:
                agreed, since = agreed + 1, since if agreed else asked
                if agreed >= (CONVERGED_ROUNDS if bound_s else 1):
                    return got, since
            else:
                agreed = 0
                if time.monotonic() - start > bound_s:
                    return got, time.monotonic() - start
            time.sleep(0.05 if verdict is None else 0.2)
