"""routers_agree's judges, on the readings a live cluster gives (each with a failing twin)."""

from __future__ import annotations

from kvalign.live.runs.replica_check import (
    LIFECYCLE_EVENTS_PER_REQUEST, judge_choices, judge_lifecycle, judge_peer_choices, lifecycle_applied, top_workers,
)
from kvalign.live.wire.metrics import parse_metrics

W0, W1 = 11, 22
NAMES = {W0: "worker0", W1: "worker1"}


def test_top_workers():
    assert top_workers({W0: 3, W1: 1}) == {W0}
    assert top_workers({W0: 2, W1: 2}) == top_workers({W0: 0, W1: 0}) == {W0, W1}


def test_replicas_naming_the_holder_agree_and_a_blind_one_does_not():
    held = {W0: 3, W1: 0}
    assert judge_choices({"router0": frozenset({W0}), "router1": frozenset({W0})}, held) is None
    verdict = judge_choices({"router0": frozenset({W0}), "router1": frozenset({W0, W1})}, held, NAMES)
    assert verdict is not None and "router1 would route to worker0/worker1" in verdict
    assert "worker0 3, worker1 0" in verdict and "so router1 routes by an index" in verdict


def test_a_tie_in_the_reference_accepts_any_tied_worker():
    held = {W0: 2, W1: 2}
    assert judge_choices({"router0": frozenset({W0}), "router1": frozenset({W1})}, held) is None
    assert judge_choices({"router0": frozenset({W1}), "router1": frozenset({W0, W1})}, {W0: 0, W1: 0}) is None


def test_peer_judge_without_a_reference():
    assert judge_peer_choices({"router0": frozenset({W0}), "router1": frozenset({W0})}) is None
    assert judge_peer_choices({"router0": frozenset({W0, W1}), "router1": frozenset({W0, W1})}) is None
    assert "router1 would route to 11/22" in judge_peer_choices({"router0": frozenset({W0}), "router1": frozenset({W0, W1})})


def test_lifecycle_every_replica_took_in_three_events_per_request():
    want = LIFECYCLE_EVENTS_PER_REQUEST
    assert judge_lifecycle({"router0": want, "router1": want}, 1) is None
    assert judge_lifecycle({"router0": 2 * want, "router1": 2 * want + 1}, 2) is None
    verdict = judge_lifecycle({"router0": 0, "router1": 0}, 1, "router1")
    assert verdict is not None and "routed by router1 publish 3" in verdict and "router0 0, router1 0" in verdict
    assert "router1" in judge_lifecycle({"router0": 3, "router1": 1}, 1)


def test_lifecycle_counter_is_read_across_label_sets():
    text = """# TYPE dynamo_component_router_active_sequence_ingress_events_applied_total counter
dynamo_component_router_active_sequence_ingress_events_applied_total{dynamo_component="backend",model="m",router_id="1"} 6
dynamo_component_router_active_sequence_ingress_events_applied_total{dynamo_component="prefill",model="m",router_id="1"} 3
# TYPE dynamo_component_kv_cache_events_applied counter
dynamo_component_kv_cache_events_applied_total{event_type="stored"} 40
"""
    assert lifecycle_applied(parse_metrics(text)) == 9
    assert lifecycle_applied(parse_metrics("# TYPE x counter\nx_total 1\n")) == 0
