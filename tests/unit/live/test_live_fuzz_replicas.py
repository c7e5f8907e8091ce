"""The fuzz's replica rules and routers_agree wiring, on a stub driver and stub replicas (no cluster)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvalign.live.runs.fuzz.invariants import InvariantFailed, Tally
from kvalign.live.runs.fuzz.prompts import Sent
from kvalign.live.runs.fuzz.replicas import FuzzReplicas

W0, W1 = 101, 202


class StubReplicas:
    """Two replicas whose answers and lifecycle counters the test sets."""

    names = ["router0", "router1"]

    def __init__(self) -> None:
        self.answer: dict[str, frozenset[int]] = {"router0": frozenset({W0}), "router1": frozenset({W0})}
        self.life = {"router0": 0.0, "router1": 0.0}
        self.per_request = {"router0": 3.0, "router1": 3.0}  # what each takes in per request

    def choices(self, tokens: Any, *, cache_salt: str | None = None) -> dict[str, frozenset[int]]:
        return dict(self.answer)

    def lifecycle(self) -> dict[str, float]:
        return dict(self.life)

    quiet_lifecycle = lifecycle

    def await_lifecycle(self, base: dict[str, float], requests: int, bound_s: float) -> dict[str, float]:
        for r in self.life:
            self.life[r] += self.per_request[r] * requests
        return {r: self.life[r] - base[r] for r in self.life}

    def await_agreement(self, tokens: Any, held: dict[int, int], bound_s: float, *, cache_salt: str | None = None):
        return self.choices(tokens), 0.25


class StubDriver:
    """What FuzzReplicas reads from the driver: worker ids, the router view, the request loop."""

    def __init__(self) -> None:
        self.cluster = SimpleNamespace(
            plan=SimpleNamespace(frontend_urls=["http://a", "http://b"],
                                 routers=SimpleNamespace(mode="events", synced=lambda i: True)),
            model="m", workers={"worker0": SimpleNamespace(instance_id=W0), "worker1": SimpleNamespace(instance_id=W1)},
            calls=[])
        self.cluster.restart_router = lambda i: self.cluster.calls.append(("restart_router", i)) or 0.5
        self.cluster.interrupt_event_plane = lambda: self.cluster.calls.append(("interrupt",))
        self.cluster.resume_event_plane = lambda: self.cluster.calls.append(("resume",))
        self.labels = ["worker0", "worker1"]
        self.prediction_views = SimpleNamespace(marks=lambda: {"worker0": 0, "worker1": 0})
        self.held = {"worker0": 3, "worker1": 0}  # leading blocks of every prompt, per worker
        self.history = [Sent((1, 2, 3), ())]
        self.tally = Tally()
        self.opts = SimpleNamespace(page_size=16, restart_grace_s=0.0)
        self.requests: list[tuple] = []
        self.said: list[str] = []

    def _held(self, views: Any, label: str, tokens: Any, lo: int, hi: Any = None, salt: Any = None) -> list[int]:
        return [self.held[label]]

    def progress(self, msg: str) -> None:
        self.said.append(msg)

    def _settle(self) -> None:
        pass

    def _rebase_applied(self) -> None:
        pass

    def _request(self, tokens: list[int], max_tokens: int, pin: str | None = None) -> None:
        self.requests.append((len(tokens), pin, self.replicas.event_plane_down))


def replicas() -> tuple[FuzzReplicas, StubDriver, StubReplicas]:
    d, r = StubDriver(), StubReplicas()
    d.replicas = FuzzReplicas(d, r)
    return d.replicas, d, r


def test_requests_alternate_between_the_replicas():
    rep, _, _ = replicas()
    assert [rep.next_url() for _ in range(3)] == ["http://a", "http://b", "http://a"]
    assert rep.served == {"router0": 2, "router1": 1} and rep.last_router == "router0"


def test_agreeing_replicas_pass_and_every_request_is_counted():
    rep, d, _ = replicas()
    rep.next_url()
    rep.after([rep.before([1, 2, 3], None, {"worker0": 0, "worker1": 0})], request=1)
    assert d.tally.checked["routers_agree"] == 1 and d.tally.failed["routers_agree"] == 0
    assert rep.checked == rep.decisive == 1


def test_a_replica_whose_index_lost_the_prompt_fails_as_diverged():
    rep, d, r = replicas()
    r.answer["router1"] = frozenset({W0, W1})
    verdict = rep.before([1, 2, 3], None, {"worker0": 0, "worker1": 0})
    with pytest.raises(InvariantFailed) as exc:
        rep.after([verdict], request=7)
    assert exc.value.invariant == "routers_agree" and exc.value.cause == "REPLICA_INDEX_DIVERGED"
    assert "router1 would route to worker0/worker1" in exc.value.detail and d.tally.failed["routers_agree"] == 1


def test_an_unsynced_replica_fails_as_unsynced_with_both_numbers():
    rep, _, r = replicas()
    r.per_request = {"router0": 0.0, "router1": 0.0}  # router1 routed it without replica sync: nobody hears of it
    rep.next_url(), rep.next_url()
    verdict = rep.before([1, 2, 3], None, {"worker0": 0, "worker1": 0})
    with pytest.raises(InvariantFailed) as exc:
        rep.after([verdict], request=2)
    assert exc.value.cause == "REPLICA_STATE_UNSYNCED" and "routed by router1" in exc.value.detail
    assert exc.value.numbers == {"lifecycle_events": {"router0": 0.0, "router1": 0.0}}


def test_lifecycle_is_not_judged_while_the_event_plane_is_down():
    rep, d, r = replicas()
    r.per_request = {"router0": 0.0, "router1": 0.0}
    rep.event_plane_down = True
    rep.after([None], request=3)
    assert d.tally.failed["routers_agree"] == 0


def test_restart_router_restarts_a_replica_other_than_router0_and_waits_for_convergence():
    rep, d, _ = replicas()
    rep.restart_router(0)
    assert d.cluster.calls == [("restart_router", 1)] and rep.converge_s["restart_router"] == [0.25]
    assert rep.faults_in_example == 1 and any("agreed" in m for m in d.said)


def test_a_replica_that_does_not_converge_fails_routers_agree():
    rep, d, r = replicas()
    r.answer["router1"] = frozenset({W1})
    with pytest.raises(InvariantFailed) as exc:
        rep.restart_router(0)
    assert exc.value.invariant == "routers_agree" and "after restart_router" in exc.value.detail


def test_interrupt_stores_one_prompt_with_the_plane_down_and_one_after():
    rep, d, _ = replicas()
    rep.interrupt_events(1, seed=5)
    assert d.cluster.calls == [("interrupt",), ("resume",)]
    assert [pin for _, pin, _ in d.requests] == ["worker1", "worker1"]
    assert [down for *_, down in d.requests] == [True, True] and not rep.event_plane_down
    assert rep.converge_s["interrupt_events"] == [0.25]


def test_nothing_to_converge_on_is_said_not_faked():
    rep, d, _ = replicas()
    d.history = []
    rep.restart_router(0)
    assert rep.converge_s["restart_router"] == [] and any("no prompt of this example" in m for m in d.said)
