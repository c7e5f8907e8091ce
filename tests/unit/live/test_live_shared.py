"""Shared live clusters' keys: equal keys exactly where the launched clusters are interchangeable."""

from __future__ import annotations

from kvalign.live.cluster import shared
from kvalign.live.cluster.shared import ClusterKey, cleared_applied
from kvalign.live.cluster.topology import CpuWorkerKind, Topology
from kvalign.live.runs.disagg_eagle import E2eOptions
from kvalign.live.wire.metrics import parse_metrics


def test_the_e2e_scenario_s_fake_cpu_cluster_is_the_router_test_s_prefill_decode_cluster():
    scenario = ClusterKey.of(E2eOptions(engine="fake-cpu").topology(), CpuWorkerKind())
    router_test = ClusterKey.of(Topology.disaggregated(2, 1, eagle=True), CpuWorkerKind(bootstrap_endpoint=True))
    assert scenario == router_test and hash(scenario) == hash(router_test)
    assert scenario.slug == "cpu-prefill2-decode1-eagle-file"


def test_every_launch_knob_separates_configurations():
    base = ClusterKey.of(Topology.aggregated(2, eagle=True), CpuWorkerKind())
    others = [
        ClusterKey.of(Topology.aggregated(2, eagle=False), CpuWorkerKind()),
        ClusterKey.of(Topology.aggregated(2, eagle=True, register_eagle=False), CpuWorkerKind()),
        ClusterKey.of(Topology.aggregated(1, eagle=True), CpuWorkerKind()),
        ClusterKey.of(Topology.aggregated(2, eagle=True, page_size=32), CpuWorkerKind()),
        ClusterKey.of(Topology.aggregated(2, eagle=True), CpuWorkerKind(token_delay_ms=5.0)),
        ClusterKey.of(Topology.aggregated(2, eagle=True), CpuWorkerKind(), "etcd-nats"),
        ClusterKey.of(Topology.aggregated(2, eagle=True), CpuWorkerKind(), namespace="other"),
        ClusterKey.of(E2eOptions(engine="fake-cpu", router_eagle=False).topology(), CpuWorkerKind()),
    ]
    assert len({base, *others}) == len(others) + 1
    assert ClusterKey.of(Topology.aggregated(2, eagle=True, register_eagle=False), CpuWorkerKind()).slug == \
        "cpu-agg2-eagle-register_off-file"


def test_the_router_side_of_a_flush_is_the_frontend_s_applied_clears(monkeypatch):
    # Dynamo 1.6.1 exports the counter without a _total suffix; prometheus_client adds one
    text = """# HELP dynamo_component_kv_cache_events_applied KV events applied
# TYPE dynamo_component_kv_cache_events_applied counter
dynamo_component_kv_cache_events_applied{dynamo_component="prefill",event_type="cleared",status="ok"} 2
dynamo_component_kv_cache_events_applied{dynamo_component="backend",event_type="cleared",status="ok"} 1
dynamo_component_kv_cache_events_applied{dynamo_component="prefill",event_type="cleared",status="block_not_found"} 5
dynamo_component_kv_cache_events_applied{dynamo_component="prefill",event_type="stored",status="ok"} 7
"""
    monkeypatch.setattr(shared, "scrape", lambda url: parse_metrics(text))
    assert cleared_applied("http://127.0.0.1:1") == 3.0
