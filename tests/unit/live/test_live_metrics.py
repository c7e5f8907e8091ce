"""Spec-decoding metric computations, fed by SGLang's real metrics collectors on CPU.

The collectors are SGLang's own ``SchedulerMetricsCollector`` (built through ``init_new`` as the
scheduler does) and ``TokenizerMetricsCollector``, driven through their own methods
(``log_stats`` every ``decode_log_interval`` decode forwards, ``observe_one_finished_request``
when a request finishes). Dynamo's own ``LabelInjectingCollector`` adds the worker labels, and
``prometheus_client``'s HTTP server serves the result on 127.0.0.1, so the parser sees what a
decode worker's ``/metrics`` serves. Each test gets a private registry through SGLang's
collector DI hooks, so collectors can be rebuilt per test.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Summary, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from kvalign.errors import UsageError
from kvalign.live.wire import metrics as m
from kvalign.oracles.base import OracleUnavailable

NUM_DRAFT_TOKENS = 4
DYNAMO_LABELS = {
    "dynamo_namespace": "kvalign-test",
    "dynamo_component": "backend",
    "dynamo_endpoint": "generate",
    "worker_id": "1f",
}


@pytest.fixture(scope="module")
def sglang_mc():
    """SGLang's metrics module under a published decode + EAGLE3 config (restored after)."""
    try:
        from kvalign.oracles.sglang import _modules

        _modules()
        from sglang.srt.observability import metrics_collector as mc
        from sglang.srt.runtime_context import get_context
    except (OracleUnavailable, ImportError) as exc:
        pytest.skip(f"SGLang metrics collectors unavailable: {exc}")
    override = get_context().override_server_args(
        enable_metrics=True, disaggregation_mode="decode", served_model_name="kvalign-test",
        speculative_algorithm="EAGLE3", speculative_num_draft_tokens=NUM_DRAFT_TOKENS,
    )
    override.install()
    yield mc
    override.restore()


class DecodeWorker:
    """A decode worker's metric side: SGLang's collectors, updated the way SGLang updates them.

    Per verify forward the scheduler accumulates accepted tokens and refreshes the spec gauges
    only when ``forward_ct % decode_log_interval == 0`` (``metrics_reporter``); the tokenizer
    manager adds ``completion_tokens`` and ``spec_verify_ct`` when a request finishes. In PD
    decode the first completion token is the prefill hand-off, with no verify behind it.
    """

    def __init__(self, mc, decode_log_interval: int = 1) -> None:
        from sglang.srt.runtime_context import get_context, get_parallel

        self.mc, self.interval = mc, decode_log_interval
        self.registry = CollectorRegistry()
        reg = self.registry

        class Scheduler(mc.SchedulerMetricsCollector):
            _counter_cls = functools.partial(Counter, registry=reg)
            _gauge_cls = functools.partial(Gauge, registry=reg)
            _histogram_cls = functools.partial(Histogram, registry=reg)
            _summary_cls = functools.partial(Summary, registry=reg)

        class Tokenizer(mc.TokenizerMetricsCollector):
            _counter_cls = functools.partial(Counter, registry=reg)
            _gauge_cls = functools.partial(Gauge, registry=reg)
            _histogram_cls = functools.partial(Histogram, registry=reg)

        with get_parallel().override(attn_tp_rank=0, attn_cp_rank=0, tp_rank=0, pp_rank=0, moe_ep_rank=0, dp_rank=None):
            ctx = Scheduler.init_new(
                server_args=get_context().server_args, enable_priority_scheduling=False,
                enable_lora=False, enable_hierarchical_cache=False,
            )
        assert ctx.collector is not None, "enable_metrics did not reach SGLang's config"
        self.scheduler = ctx.collector
        # SGLang's GaugeHistogram bypasses the DI hooks and registers in the global registry;
        # move it to this worker's registry so the next test can build a fresh worker.
        from prometheus_client import REGISTRY
        from sglang.srt.utils.gauge_histogram import GaugeHistogram

        for attr in vars(self.scheduler).values():
            if isinstance(attr, GaugeHistogram):
                REGISTRY.unregister(attr._gauge)
                reg.register(attr._gauge)
        self.tokenizer = Tokenizer(server_args=get_context().server_args, labels=mc.tokenizer_metric_labels())
        self.forward_ct = self.window_accept = self.window_forwards = 0

    def serve(self, steps: list[int], *, streaming: bool = True) -> None:
        """One request: the hand-off token, then one verify forward per entry of ``steps``
        (tokens that forward emitted: accepted drafts + the bonus token)."""
        for emitted in steps:
            self.forward_ct += 1
            self.window_accept += emitted
            self.window_forwards += 1
            if self.forward_ct % self.interval == 0:
                accept_length = self.window_accept / self.window_forwards
                accept_rate = (self.window_accept - self.window_forwards) / (self.window_forwards * (NUM_DRAFT_TOKENS - 1))
                self.scheduler.log_stats(self.mc.SchedulerStats(
                    spec_accept_length=accept_length, spec_accept_rate=accept_rate,
                    spec_num_draft_tokens=NUM_DRAFT_TOKENS, spec_num_steps=NUM_DRAFT_TOKENS - 1,
                ))
                self.window_accept = self.window_forwards = 0
        self.tokenizer.observe_one_finished_request(
            self.tokenizer.labels, prompt_tokens=40, generation_tokens=1 + sum(steps), cached_tokens=0,
            e2e_latency=0.1, has_grammar=False, spec_verify_ct=len(steps), is_streaming=streaming,
        )


@pytest.fixture
def worker(sglang_mc):
    return DecodeWorker(sglang_mc)


@pytest.fixture
def served(worker):
    """The worker's /metrics on 127.0.0.1, labelled by Dynamo's own label injector."""
    try:
        from dynamo.common.utils.label_injecting_collector import LabelInjectingCollector
    except ImportError as exc:
        pytest.skip(f"Dynamo's label injector unavailable: {exc}")
    exposed = CollectorRegistry()
    exposed.register(LabelInjectingCollector(worker.registry, DYNAMO_LABELS))
    # prometheus_client's start_http_server, but serving with a 10 ms poll: its default 0.5 s poll is what
    # shutdown() waits out, once per test (2.6 s of this file's 5.9 s in the quiet -n 2 run)
    server = make_server("127.0.0.1", 0, make_wsgi_app(exposed), ThreadingWSGIServer, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}/metrics"
    server.shutdown()
    thread.join(timeout=5)
    server.server_close()


class _Quiet(WSGIRequestHandler):
    """No access log line per scrape (prometheus_client's own handler is private)."""

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the overridden signature
        pass


def test_counters_are_summed_across_label_sets(worker, served):
    worker.serve([3, 3, 3], streaming=True)
    worker.serve([2, 2], streaming=False)  # a second is_streaming label set
    snap = m.scrape(served)
    assert sorted(snap.values(m.GENERATION_TOKENS)) == [5.0, 10.0]
    assert snap.total(m.GENERATION_TOKENS) == 15.0
    assert snap.total(m.FINISHED_REQUESTS) == 2.0
    assert snap.total(m.SPEC_VERIFY_CALLS) == 5.0
    assert snap.type_of(m.SPEC_VERIFY_CALLS) == "counter"
    assert snap.type_of(m.SPEC_ACCEPT_LENGTH) == "gauge"


def test_scenario_with_accepted_drafts_passes(worker, served):
    """4 sequential 10-token requests (max_tokens=10), 3 tokens per verify: both estimates 3.0."""
    before = m.scrape(served)
    after_each = []
    for _ in range(4):
        worker.serve([3, 3, 3])
        after_each.append(m.scrape(served))
    win = m.spec_window(before, after_each)
    assert (win.verify_calls, win.generation_tokens, win.finished_requests) == (12.0, 40.0, 4.0)
    assert win.accept_lengths == (3.0, 3.0, 3.0, 3.0)
    assert win.tokens_per_verify == pytest.approx(3.0)
    assert win.accept_rate == pytest.approx(2 / 3)
    assert _failures(win) == []


def test_zero_acceptance_fails_although_the_naive_ratio_passes(worker, served):
    """5-token outputs with nothing accepted: gen/verify = 5/4 = 1.25 > 1.2, a false pass."""
    before = m.scrape(served)
    after_each = []
    for _ in range(4):
        worker.serve([1, 1, 1, 1])
        after_each.append(m.scrape(served))
    win = m.spec_window(before, after_each)
    naive = win.generation_tokens / win.verify_calls
    assert naive == pytest.approx(1.25) and naive > m.MIN_TOKENS_PER_VERIFY
    assert win.accept_length == pytest.approx(1.0)
    assert win.tokens_per_verify == pytest.approx(1.0)
    failures = _failures(win)
    assert len(failures) == 2
    assert "sglang:spec_accept_length = 1.000" in failures[0]
    assert "(20 − 4) / 16 = 1.000" in failures[1]


def test_probe_requests_without_verify_do_not_move_the_estimate(worker, served):
    """A frontend readiness probe (max_tokens=1) adds a token and a request but no verify."""
    before = m.scrape(served)
    worker.serve([])  # probe inside the window
    probe = m.scrape(served)
    worker.serve([2, 2, 2, 2])
    win = m.spec_window(before, [probe, m.scrape(served)])
    assert (win.generation_tokens, win.finished_requests, win.verify_calls) == (10.0, 2.0, 4.0)
    assert win.tokens_per_verify == pytest.approx(2.0)
    assert win.accept_lengths == (2.0,)  # the probe's scrape saw no verify: its gauge is not counted


def test_stale_gauge_without_verify_in_the_window_fails(worker, served):
    worker.serve([4, 4])  # earlier traffic leaves the gauge at 4.0
    before = m.scrape(served)
    worker.serve([])
    worker.serve([])
    win = m.spec_window(before, [m.scrape(served)])
    assert win.accept_lengths == ()
    failures = _failures(win)
    assert len(failures) == 1 and "ran no verify step" in failures[0]


def test_default_log_interval_leaves_the_gauge_unset(sglang_mc):
    """With SGLang's default --decode-log-interval 40, 4 short requests never refresh the gauge."""
    worker = DecodeWorker(sglang_mc, decode_log_interval=40)
    before = m.parse_metrics(_exposition(worker))
    snaps = []
    for _ in range(4):
        worker.serve([3, 3, 3])
        snaps.append(m.parse_metrics(_exposition(worker)))
    assert not snaps[-1].has(m.SPEC_ACCEPT_LENGTH)
    win = m.spec_window(before, snaps)
    assert win.tokens_per_verify == pytest.approx(3.0)
    failures = _failures(win)
    assert len(failures) == 1 and "--decode-log-interval 1" in failures[0]


def _failures(win: m.SpecDecodeWindow) -> list[str]:
    """Assertions 3 and 4 of the live scenario, in the order it checks them."""
    return m.verify_failures(win) or m.accept_failures(win)


def _exposition(worker: DecodeWorker) -> str:
    from prometheus_client import generate_latest

    return generate_latest(worker.registry).decode()


def test_gauges_are_averaged_not_summed():
    text = (
        "# TYPE sglang:spec_accept_length gauge\n"
        'sglang:spec_accept_length{tp_rank="0"} 2.0\n'
        'sglang:spec_accept_length{tp_rank="1"} 3.0\n'
    )
    snap = m.parse_metrics(text)
    assert snap.mean(m.SPEC_ACCEPT_LENGTH) == 2.5
    assert snap.total(m.SPEC_ACCEPT_LENGTH) == 5.0


def test_window_needs_a_scrape_after_it_starts():
    with pytest.raises(ValueError, match="at least one scrape"):
        m.spec_window(m.parse_metrics(""), [])


@pytest.mark.parametrize("text", ["<html><body>502 Bad Gateway</body></html>\n", "sglang:x{a=\"1\"} notanumber\n"])
def test_non_prometheus_text_is_rejected(text):
    with pytest.raises(ValueError, match="not Prometheus text exposition"):
        m.parse_metrics(text)


def test_unreachable_url_is_one_usage_error(unused_port):
    with pytest.raises(UsageError, match=f"cannot reach http://127.0.0.1:{unused_port}/metrics"):
        m.scrape(f"http://127.0.0.1:{unused_port}/metrics", timeout=2)


def test_metrics_cli_prints_spec_figures(worker, served, capsys):
    """What ``kvalign metrics`` prints, through the CLI's own ``main`` in this process (a child interpreter
    importing kvalign cost 0.7 CPU-s for the same output; the exit code as a process is the next test's)."""
    from kvalign.cli import main

    worker.serve([3, 3, 3])
    worker.serve([2, 2, 2, 2, 1])
    rc = main(["metrics", served])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "sglang:spec_verify_calls_total" in out and " 8" in out
    assert "sglang:generation_tokens_total" in out
    assert "tokens per verify (counters, since start): (20 - 2) / 8 = 2.250" in out


def test_metrics_cli_unreachable_url_exits_2(unused_port):
    proc = subprocess.run(
        [sys.executable, "-m", "kvalign", "metrics", f"http://127.0.0.1:{unused_port}/metrics"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("kvalign: error: cannot reach")
    assert "Traceback" not in proc.stderr


@pytest.fixture
def unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
