"""The frontend counters the fuzz reads, parsed from Dynamo 1.6.1's exposition format (served on loopback)."""

from __future__ import annotations

import pytest

from kvalign.live.runs.fuzz.surfaces import MetricReader, SurfaceMissing, prefill_reused_total
from kvalign.live.wire.metrics import parse_metrics

# The shape of Dynamo 1.6.1's frontend /metrics (names and labels as a live run printed them).
FRONTEND = """# HELP dynamo_component_kv_cache_events_applied Total number of KV cache events applied to index
# TYPE dynamo_component_kv_cache_events_applied counter
dynamo_component_kv_cache_events_applied{dynamo_component="backend",event_type="stored",status="ok"} 12
dynamo_component_kv_cache_events_applied{dynamo_component="backend",event_type="removed",status="ok"} 7
dynamo_component_kv_cache_events_applied{dynamo_component="backend",event_type="removed",status="block_not_found"} 2
dynamo_component_kv_cache_events_applied{dynamo_component="backend",event_type="cleared",status="ok"} 1
dynamo_component_kv_cache_events_applied{dynamo_component="prefill",event_type="stored",status="ok"} 40
# HELP dynamo_component_router_kv_worker_reused_tokens_total reused tokens
# TYPE dynamo_component_router_kv_worker_reused_tokens_total counter
dynamo_component_router_kv_worker_reused_tokens_total{phase="prefill"} 176
dynamo_component_router_kv_worker_reused_tokens_total{phase="decode"} 9
"""


@pytest.fixture
def frontend(metrics_page):
    url, served = metrics_page
    served["text"] = FRONTEND
    return url, served


def test_events_applied_sums_every_type_and_status_of_the_asked_components(frontend):
    url, served = frontend
    reader = MetricReader(url, {})
    assert reader.events_applied(["backend"]) == 12 + 7 + 2 + 1
    assert reader.events_applied(["prefill"]) == 40
    assert reader.events_applied(["backend", "prefill"]) == 62
    assert reader.events_applied(["decode"]) is None  # no such component: no counter, not 0
    served["text"] = "# TYPE other counter\nother_total 3\n"
    assert reader.events_applied(["backend"]) is None


def test_prefill_reuse_is_the_prefill_phase_only(frontend):
    url, _ = frontend
    assert MetricReader(url, {}).prefill_reused() == 176
    assert prefill_reused_total(parse_metrics("# TYPE x counter\nx_total 1\n")) is None


def test_an_unreachable_frontend_is_a_missing_surface():
    reader = MetricReader("http://127.0.0.1:9", {})
    with pytest.raises(SurfaceMissing):
        reader.events_applied(["backend"])


def test_a_missing_prefill_counter_after_a_request_is_a_missing_surface_naming_it(frontend):
    """A renamed or dropped counter is exit 2 naming it, never a 0 read as the engine's reuse (which
    would fail ``router_credits_engine_reuse`` on a router that credited the pages)."""
    url, served = frontend
    served["text"] = FRONTEND.replace("router_kv_worker_reused_tokens_total", "router_kv_worker_reused_tokens_renamed")
    reader = MetricReader(url, {})
    assert reader.prefill_reused(before_first_report=True) == 0  # not exported before the first report
    with pytest.raises(SurfaceMissing, match=r"router_kv_worker_reused_tokens_total\{phase=\"prefill\"\}"):
        reader.prefill_reused()
    served["text"] = FRONTEND.replace('phase="prefill"', 'phase="decode"')  # the decode phase alone: still missing
    with pytest.raises(SurfaceMissing):
        reader.prefill_reused()


def test_a_missing_surface_stops_the_run_as_an_environment_error_naming_it():
    from kvalign.live.runs.fuzz.driver import FuzzDriver
    from kvalign.live.runs.fuzz.options import FuzzEnvironmentError

    d = object.__new__(FuzzDriver)
    d.steps, d.steps_run = [], 0

    def run(_rule, _step):
        raise SurfaceMissing("http://127.0.0.1:1/metrics exports no *router_kv_worker_reused_tokens_total")

    d._run = run
    with pytest.raises(FuzzEnvironmentError, match="surface is missing: .*router_kv_worker_reused_tokens_total"):
        d.run_step({"rule": "request"})


def test_a_batchs_chained_stores_count_once_in_the_applied_unit():
    """Dynamo 1.6.1's frontend counted a batch of two stores, the second under the first's last page, as one
    applied event (a merged batch, live); every other event counts once."""
    from kvalign.live.runs.fuzz.surfaces import applied_units
    from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored

    a = BlockStored([1, 2, 3], None, list(range(48)), 16)
    b = BlockStored([4], 3, list(range(16)), 16)
    other = BlockStored([9], 7, list(range(16)), 16)
    assert applied_units([a, b]) == 1 and applied_units([a]) == applied_units([b]) == 1
    assert applied_units([a, other]) == 2 and applied_units([b, a]) == 2  # not under the store before it
    assert applied_units([a, BlockRemoved([3]), b]) == 3 and applied_units([AllBlocksCleared(), a]) == 2


def test_a_batchs_consecutive_removals_of_one_medium_count_once_in_the_applied_unit():
    """vLLM publishes one ``BlockRemoved`` per block; Dynamo 1.6.1's frontend counted a batch of 9 removals and a
    store as one removal and one store (live, the vLLM fuzz cluster). Counted one per event, every such settle
    waited out its bound. A removal of another medium, or one after a store, starts a new unit."""
    from kvalign.live.runs.fuzz.surfaces import applied_units
    from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored

    store = BlockStored([1], None, list(range(16)), 16)
    nine = [BlockRemoved([h]) for h in range(9)]
    assert applied_units([*nine, store]) == 2 and applied_units(nine[:3] + [store, store]) == 3
    assert applied_units([BlockRemoved([1]), BlockRemoved([2], "CPU")]) == 2
    assert applied_units([BlockRemoved([1]), store, BlockRemoved([2])]) == 3
    assert applied_units([BlockRemoved([1]), AllBlocksCleared(), BlockRemoved([2])]) == 3


# The decode worker's page as SGLang 0.5.23 exports it (the families the speculation check reads, among others).
DECODE = """# HELP sglang:spec_verify_calls_total verify calls
# TYPE sglang:spec_verify_calls_total counter
sglang:spec_verify_calls_total{model_name="m"} 10
# HELP sglang:generation_tokens_total generated
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m"} 30
# HELP sglang:num_requests_total finished
# TYPE sglang:num_requests_total counter
sglang:num_requests_total{model_name="m"} 5
# HELP sglang:spec_accept_length accept length
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{model_name="m"} 2.0
# HELP sglang:e2e_request_latency_seconds latency
# TYPE sglang:e2e_request_latency_seconds histogram
sglang:e2e_request_latency_seconds_bucket{le="0.1",model_name="m"} 3
sglang:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 5
sglang:e2e_request_latency_seconds_sum{model_name="m"} 0.4
sglang:e2e_request_latency_seconds_count{model_name="m"} 5
"""


def test_a_scrape_parses_only_the_families_a_check_reads():
    from kvalign.live.wire.metrics import only_families, parse_metrics

    full, only = parse_metrics(DECODE), parse_metrics(only_families(DECODE, ("sglang:spec_", "sglang:num_requests")))
    assert only.total("sglang:spec_verify_calls_total") == 10 and only.mean("sglang:spec_accept_length") == 2.0
    assert only.total("sglang:num_requests_total") == 5 and only.type_of("sglang:num_requests_total") == "counter"
    assert not only.has("sglang:generation_tokens_total") and full.has("sglang:e2e_request_latency_seconds_count")
    assert not only.has("sglang:e2e_request_latency_seconds_count")
    applied = parse_metrics(only_families(FRONTEND, ("kv_cache_events_applied",)))
    assert applied.names() == ["dynamo_component_kv_cache_events_applied_total"]


def test_a_decode_workers_last_scrape_is_its_next_before_until_it_serves_unscraped(frontend):
    """The scrape that closed a speculation window on a worker is its next window's "before"; a worker
    that served something unscraped (or every worker, after a burst or a restart) is scraped anew."""
    url, served = frontend
    served["text"] = DECODE
    reader = MetricReader(url, {"w0": f"{url}/metrics", "w1": f"{url}/metrics"})
    before = reader.decode(["w0", "w1"])
    assert served["gets"] == 2
    reader.after("w0")  # a window on w0 closed
    assert served["gets"] == 3
    assert reader.decode(["w0", "w1"]) == {"w0": reader._last["w0"], "w1": before["w1"]} and served["gets"] == 3
    reader.forget("w1")  # w1 served a request no scrape followed
    reader.decode(["w0", "w1"])
    assert served["gets"] == 4
    reader.forget()
    reader.decode(["w0", "w1"])
    assert served["gets"] == 6
    fresh = reader.after("w1")  # a data-parallel worker's per-rank window reads its own fresh scrape
    assert served["gets"] == 7 and reader.decode(["w1"]) == {"w1": fresh} and served["gets"] == 7
