"""Decode speculation judged over windows of requests: one decode-worker scrape per window, not per request.

``decode_keeps_speculating`` reads a decode worker's ``/metrics`` page: SGLang's multiprocess
registry, gathered afresh by Dynamo's system server on every scrape (20-30 ms on the 2-core
machine, idle or not). One scrape after every request was most of what the live fuzz cost over the
same requests sent bare: ``bench/bench_fuzz.py`` measured 1.56x with it and 1.03x without it
(docs/benchmarks.md). The counters the invariant reads (generation tokens, verify calls, finished
requests) move only when a request finishes (SGLang 0.5.23's
``TokenizerManager.observe_one_finished_request``), so over consecutive requests on one decode
worker they are the sums of each request's, and one scrape before and one after judge them together.

A window is one decode worker's requests sent alone, asked for at least :data:`MIN_SPEC_TOKENS`
tokens. It is closed (scraped and judged) when it holds ``size`` requests, before any step that
could move the worker's counters without a window to hold them (a burst, a flush, a restart, a
dropped batch, a request asked for fewer tokens), and when the example ends. On a data-parallel
worker each rank's requests are judged on that rank's samples (:func:`.dp_ranks.rank_samples`).

What a window gives up: one request that alone stopped speculating among ``size`` that did is
averaged with them. The faults this invariant is for (a draft the target disagrees with, speculation
off on the decode worker) stop it for every request, and a failing example shrinks to a few requests,
where a window holds one. ``--spec-window 1`` judges every request alone, at the old cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from kvalign.live.cluster import ranks
from kvalign.live.runs.fuzz.dp_ranks import rank_samples
from kvalign.live.runs.fuzz.invariants import MIN_SPEC_TOKENS, InvariantFailed, Tally
from kvalign.live.runs.fuzz.surfaces import SurfaceMissing
from kvalign.live.wire.metrics import SPEC_VERIFY_CALLS, MetricsSnapshot, SpecDecodeWindow, accept_failures, spec_window

INVARIANT = "decode_keeps_speculating"
DEFAULT_SIZE = 4


class DecodeCounters(Protocol):
    """What windows need of :class:`.surfaces.MetricReader`: the decode workers' counters."""

    decode_urls: dict[str, str]

    def decode(self, labels: Sequence[str]) -> dict[str, MetricsSnapshot]: ...

    def after(self, label: str) -> MetricsSnapshot: ...

    def forget(self, label: str | None = None) -> None: ...


@dataclass
class Member:
    """One request in a window."""

    request: int
    source: str  # the source label it ran on (``worker`` or ``worker.dpN``)
    decoded: int  # tokens it generated


@dataclass
class Window:
    """Requests on one decode worker since ``before`` was scraped."""

    worker: str
    before: MetricsSnapshot
    members: list[Member] = field(default_factory=list)


@dataclass(frozen=True)
class Judged:
    """One judged window (a rank's share of it on a data-parallel worker)."""

    worker: str
    rank: int | None
    requests: tuple[int, ...]
    window: SpecDecodeWindow
    problems: tuple[str, ...]

    @property
    def where(self) -> str:
        """The decode worker, and its rank on a data-parallel worker."""
        return self.worker if self.rank is None else f"{self.worker} rank {self.rank}"

    def describe(self) -> str:
        tpv = self.window.tokens_per_verify
        return (f"requests {', '.join(map(str, self.requests))} on {self.where}: tokens/verify "
                f"{'n/a' if tpv is None else f'{tpv:.3f}'}")


class SpecWindows:
    """The open windows of a run, and their judgment into ``tally``.

    ``on_judged`` hears each judgment (the driver writes its tokens-per-verify into the requests'
    records and prints it); a failing window raises :class:`InvariantFailed` naming its requests."""

    def __init__(self, counters: DecodeCounters, tally: Tally, size: int = DEFAULT_SIZE,
                 on_judged: Callable[[Judged], None] = lambda j: None) -> None:
        if size < 1:
            raise ValueError(f"--spec-window must be >= 1, got {size}")
        self.counters, self.tally, self.size, self.on_judged = counters, tally, size, on_judged
        self.open: dict[str, Window] = {}

    def before_request(self, max_tokens: int) -> dict[str, MetricsSnapshot] | None:
        """Before a request is sent alone: each decode worker's counters now (scraped only where not
        known), or None when the request will not be judged. A request asked for fewer than
        :data:`MIN_SPEC_TOKENS` tokens cannot show acceptance and would dilute a window, and which
        worker it lands on is the router's choice: every open window is closed first."""
        if max_tokens < MIN_SPEC_TOKENS:
            self.close_all()
            return None
        return self.counters.decode(list(self.counters.decode_urls))

    def add(self, worker: str, member: Member, before: MetricsSnapshot) -> None:
        """``member`` ran alone on decode worker ``worker``; a full window is judged now. A member
        that decoded fewer than :data:`MIN_SPEC_TOKENS` (an early stop) stays in: its counters are in
        the window's, and its token or two per verify step can only lower the window's figure, never
        hide a failure. ``before``: the worker's counters when the request was sent
        (:meth:`before_request`), a new window's start."""
        window = self.open.get(worker)
        if window is None:
            window = self.open[worker] = Window(worker, before)
        window.members.append(member)
        if len(window.members) >= self.size:
            self.close(worker)

    def close_all(self) -> None:
        """Judge every open window (before a step that may move any worker's counters, and at the end),
        the workers scraped at once: each scrape waits on its own worker's process."""
        workers = list(self.open)
        if len(workers) > 1:
            with ThreadPoolExecutor(len(workers)) as pool:
                afters = dict(zip(workers, pool.map(self.counters.after, workers)))
        else:
            afters = {}
        for worker in workers:
            self.close(worker, afters.get(worker))

    def discard(self) -> None:
        """Drop the open windows unjudged (the example already failed, or a new one begins) and every
        kept "before": counters moved that no window accounts for."""
        self.open.clear()
        self.counters.forget()

    def close(self, worker: str, after: MetricsSnapshot | None = None) -> None:
        """Scrape ``worker`` once (unless ``after`` is that scrape) and judge its window, each rank on
        its own samples."""
        window = self.open.pop(worker)
        after = self.counters.after(worker) if after is None else after
        if not after.has(SPEC_VERIFY_CALLS):
            raise SurfaceMissing(f"{self.counters.decode_urls[worker]} exports no {SPEC_VERIFY_CALLS}: the decode "
                                 "worker needs --enable-metrics and a speculative algorithm")
        by_rank: dict[int | None, list[Member]] = {}
        for m in window.members:
            by_rank.setdefault(ranks.split_label(m.source)[1], []).append(m)
        failed: list[Judged] = []
        for rank, members in by_rank.items():
            win = spec_window(rank_samples(window.before, rank), [rank_samples(after, rank)])
            if win.verify_calls <= 0 and all(m.decoded < MIN_SPEC_TOKENS for m in members):
                continue  # every request stopped early, before a decode step: no verify step could run to judge
            judged = Judged(worker, rank, tuple(m.request for m in members), win, tuple(accept_failures(win)))
            self.tally.checked[INVARIANT] += 1
            if judged.problems:
                self.tally.failed[INVARIANT] += 1
                failed.append(judged)
            self.on_judged(judged)
        if failed:
            raise failure(failed[0], {m.request: m.decoded for m in window.members})


def failure(judged: Judged, decoded: dict[int, int]) -> InvariantFailed:
    """The finding a failing window is reported as: its last request, and every request it held."""
    held = ", ".join(f"{r} ({decoded[r]} tokens decoded)" for r in judged.requests)
    alone = " (judged together: --replay SCRIPT --spec-window 1 judges each alone)" if len(judged.requests) > 1 else ""
    return InvariantFailed(INVARIANT, f"requests {held} on {judged.where}{alone}: " + "; ".join(judged.problems),
                           worker=judged.where, request=judged.requests[-1],
                           numbers={"tokens_per_verify": judged.window.tokens_per_verify,
                                    "window_requests": list(judged.requests)})
