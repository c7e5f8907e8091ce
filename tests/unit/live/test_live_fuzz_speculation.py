"""Speculation windows (kvalign/live/runs/fuzz/speculation.py): one decode-worker scrape per window,
the same verdict as judging each request, and the negative control (a draft the target disagrees with)
failing the window that holds it, naming its requests.

The decode workers' pages are served on loopback in SGLang 0.5.23's exposition shape, their counters
moved the way SGLang moves them when a request finishes (generation tokens, verify calls, finished
requests) and the gauge the way its scheduler sets it (the last decode batch's accept length)."""

from __future__ import annotations

import math

import pytest

from kvalign.live.runs.fuzz.invariants import MIN_SPEC_TOKENS, InvariantFailed, Tally
from kvalign.live.runs.fuzz.speculation import Member, SpecWindows
from kvalign.live.runs.fuzz.surfaces import MetricReader, SurfaceMissing


class Decode:
    """One decode worker's SGLang counters, per data-parallel rank (None: no dp_rank label)."""

    def __init__(self, ranks: tuple[int | None, ...] = (None,)) -> None:
        self.c = {r: {"verify": 0.0, "gen": 0.0, "fin": 0.0, "gauge": 0.0} for r in ranks}

    def serve(self, decoded: int, *, accepted: bool = True, rank: int | None = None) -> None:
        """A request finishing: the first token from the prefill forward, then one draft token per
        verify step (the CPU engine), accepted (2 tokens a step) or not (1)."""
        c = self.c[rank]
        steps = math.ceil((decoded - 1) / 2) if accepted else decoded - 1
        c["verify"] += steps
        c["gen"] += decoded
        c["fin"] += 1
        if steps:
            c["gauge"] = 2.0 if accepted else 1.0

    def page(self) -> str:
        out = []
        for name, key, kind in (("sglang:spec_verify_calls_total", "verify", "counter"),
                                ("sglang:generation_tokens_total", "gen", "counter"),
                                ("sglang:num_requests_total", "fin", "counter"),
                                ("sglang:spec_accept_length", "gauge", "gauge")):
            out += [f"# HELP {name} x", f"# TYPE {name} {kind}"]
            for rank, c in self.c.items():
                labels = 'model_name="m"' + ("" if rank is None else f',dp_rank="{rank}"')
                out.append(f"{name}{{{labels}}} {c[key]}")
        return "\n".join(out) + "\n"


@pytest.fixture
def cluster(metrics_page):
    """Two decode workers behind one loopback server: (windows factory, workers, served)."""
    url, served = metrics_page
    workers = {"w0": Decode(), "w1": Decode()}

    def publish() -> None:
        served["pages"] = {f"/{name}": w.page() for name, w in workers.items()}

    def windows(size: int = 3):
        publish()
        judged: list = []
        reader = MetricReader(url, {name: f"{url}/{name}" for name in workers})
        return SpecWindows(reader, Tally(), size, judged.append), judged

    return windows, workers, served, publish


def run(spec: SpecWindows, workers: dict, publish, name: str, request: int, decoded: int = 12, *,
        accepted: bool = True, source: str | None = None, max_tokens: int | None = None) -> None:
    """One request sent alone as the driver sends it: counters before, serve, add."""
    before = spec.before_request(max_tokens or decoded)
    rank = None if source is None or ".dp" not in source else int(source.rsplit("dp", 1)[1])
    workers[name].serve(decoded, accepted=accepted, rank=rank)
    publish()
    if before is not None:
        spec.add(name, Member(request, source or name, decoded), before[name])


def test_a_window_of_requests_costs_one_scrape_and_is_judged_once(cluster):
    windows, workers, served, publish = cluster
    spec, judged = windows(size=3)
    for r in (1, 2, 3):
        run(spec, workers, publish, "w0", r)
    assert served["gets"] == 2 + 1  # each worker's "before" once, then the full window's close
    assert spec.tally.checked["decode_keeps_speculating"] == 1 and spec.tally.failed["decode_keeps_speculating"] == 0
    assert [j.requests for j in judged] == [(1, 2, 3)] and judged[0].window.tokens_per_verify == pytest.approx(33 / 18)
    run(spec, workers, publish, "w0", 4)  # the closing scrape is the next window's "before": no scrape
    assert served["gets"] == 3 and list(spec.open) == ["w0"]


def test_size_1_judges_every_request_alone(cluster):
    windows, workers, served, publish = cluster
    spec, judged = windows(size=1)
    for r in (1, 2, 3):
        run(spec, workers, publish, "w0" if r != 2 else "w1", r)
    assert [j.requests for j in judged] == [(1,), (2,), (3,)] and served["gets"] == 2 + 3


def test_negative_control_a_disagreeing_draft_fails_its_window_naming_its_requests(cluster):
    windows, workers, _served, publish = cluster
    spec, _judged = windows(size=2)
    run(spec, workers, publish, "w1", 1)  # another worker's window is not this one's
    run(spec, workers, publish, "w0", 2, accepted=False)
    with pytest.raises(InvariantFailed) as exc:
        run(spec, workers, publish, "w0", 3, accepted=False)
    f = exc.value
    assert f.invariant == "decode_keeps_speculating" and f.request == 3 and f.worker == "w0"
    assert f.numbers == {"tokens_per_verify": 1.0, "window_requests": [2, 3]}
    assert "requests 2 (12 tokens decoded), 3 (12 tokens decoded) on w0" in f.detail and "not > 1.2" in f.detail
    assert "--spec-window 1 judges each alone" in f.detail
    assert spec.tally.failed["decode_keeps_speculating"] == 1
    spec.close_all()  # w1's window still judges on its own, and passes
    assert spec.tally.checked["decode_keeps_speculating"] == 2 and spec.tally.failed["decode_keeps_speculating"] == 1


def test_a_request_asked_for_too_few_tokens_closes_every_open_window_first(cluster):
    """Which worker it lands on is the router's choice, and its one verify step would dilute a window."""
    windows, workers, _served, publish = cluster
    spec, judged = windows(size=4)
    run(spec, workers, publish, "w0", 1)
    run(spec, workers, publish, "w1", 2)
    run(spec, workers, publish, "w0", 3, decoded=MIN_SPEC_TOKENS - 1)
    assert sorted(j.requests for j in judged) == [(1,), (2,)] and not spec.open


def test_the_example_end_judges_open_windows_and_a_failed_example_drops_them(cluster):
    windows, workers, served, publish = cluster
    spec, judged = windows(size=4)
    run(spec, workers, publish, "w0", 1)
    spec.close_all()
    assert [j.requests for j in judged] == [(1,)]
    run(spec, workers, publish, "w0", 2, accepted=False)
    gets = served["gets"]
    spec.discard()  # the example failed on another invariant: nothing judged, every "before" forgotten
    assert not spec.open and spec.tally.checked["decode_keeps_speculating"] == 1 and served["gets"] == gets
    spec.before_request(12)
    assert served["gets"] == gets + 2


def test_each_rank_of_a_data_parallel_worker_is_judged_on_its_own_samples(cluster):
    """Rank 0 speculates, rank 1 does not: read over both ranks the window would pass (33 tokens over
    23 verify steps, 1.43, and a gauge of 1.5); each rank judged on its own samples, rank 1 fails."""
    windows, workers, _served, publish = cluster
    workers["w0"] = Decode(ranks=(0, 1))
    spec, judged = windows(size=3)
    run(spec, workers, publish, "w0", 1, source="w0.dp0")
    run(spec, workers, publish, "w0", 2, source="w0.dp0")
    with pytest.raises(InvariantFailed) as exc:
        run(spec, workers, publish, "w0", 3, accepted=False, source="w0.dp1")
    assert {(j.rank, j.requests) for j in judged} == {(0, (1, 2)), (1, (3,))}
    assert exc.value.worker == "w0 rank 1" and exc.value.numbers["window_requests"] == [3]


def test_a_decode_worker_without_speculation_metrics_is_a_missing_surface(cluster):
    windows, workers, served, publish = cluster
    spec, _ = windows(size=1)
    spec.before_request(12)
    served["pages"] = {"/w0": "# TYPE sglang:num_requests_total counter\nsglang:num_requests_total 1\n"}
    with pytest.raises(SurfaceMissing, match="exports no sglang:spec_verify_calls_total"):
        spec.add("w0", Member(1, "w0", 12), spec.counters.decode(["w0"])["w0"])


def test_a_window_of_no_request_is_refused(cluster):
    windows, *_ = cluster
    with pytest.raises(ValueError, match="--spec-window must be >= 1"):
        windows(size=0)


def test_a_window_whose_requests_all_stopped_before_a_decode_step_is_not_judged(cluster):
    """A request asked for enough tokens that stopped after its prefill token (seen in CI: 1 token of 6) ran
    no verify step: there is no acceptance to measure, so its window is left unjudged, not failed. The
    control: the same empty counters under a request that decoded tokens fail, naming it."""
    windows, workers, _served, publish = cluster
    spec, judged = windows(size=1)
    run(spec, workers, publish, "w0", 1, decoded=1, max_tokens=6)
    assert judged == [] and spec.tally.checked["decode_keeps_speculating"] == 0
    before = spec.before_request(6)
    workers["w0"].c[None]["gen"] += 6  # six tokens decoded, not one verify step
    workers["w0"].c[None]["fin"] += 1
    publish()
    with pytest.raises(InvariantFailed) as exc:
        spec.add("w0", Member(2, "w0", 6), before["w0"])
    assert exc.value.request == 2 and "no verify step" in exc.value.detail
