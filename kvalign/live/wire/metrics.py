"""Prometheus scrapes of a worker's ``/metrics`` and the speculative-decoding figures from them.

The live layer must prove that decode *keeps speculating* after the KV and EAGLE state hand-off,
and that proof is easy to fake by accident (live-e2e.md §3):

* ``sglang:spec_accept_length`` is the metric whose definition is "tokens per verify step"
  (accepted drafts + the bonus token), but it is a gauge refreshed only every
  ``--decode-log-interval`` decode forwards; with interval 1 it holds the *last* verify step of
  the last request. A reading therefore only counts when the verify counter moved since the
  previous reading (otherwise it is stale);
* ``generation_tokens_total / spec_verify_calls_total`` passes at *zero* acceptance: in PD
  decode the first token of every request comes from prefill with no verify behind it, so
  5-token outputs give 5/4 = 1.25. The unbiased counter form is
  ``(Δgeneration_tokens − Δfinished requests) / Δverify calls`` over a test window.

Counters are summed across label sets (Dynamo injects its own labels; ``is_streaming`` splits
SGLang's). A per-step *mean* gauge is never summed: ranks are averaged instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import requests
from prometheus_client.parser import text_string_to_metric_families

from kvalign.errors import UsageError

SPEC_VERIFY_CALLS = "sglang:spec_verify_calls_total"
GENERATION_TOKENS = "sglang:generation_tokens_total"
FINISHED_REQUESTS = "sglang:num_requests_total"
SPEC_ACCEPT_LENGTH = "sglang:spec_accept_length"
SPEC_ACCEPT_RATE = "sglang:spec_accept_rate"
SPEC_NUM_DRAFT_TOKENS = "sglang:spec_num_draft_tokens"
#: Prefill's own record of each request it handed to decode over a real backend (one observation per
#: request; SGLang's ``fake`` backend observes nothing): histograms, read as ``_count`` / ``_sum``.
KV_TRANSFER_TOTAL_MB = "sglang:kv_transfer_total_mb"
KV_TRANSFER_LATENCY_MS = "sglang:kv_transfer_latency_ms"

MIN_TOKENS_PER_VERIFY = 1.2


@dataclass(frozen=True)
class Sample:
    """One exposition line: sample name, its label set and value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


class MetricsSnapshot:
    """One scrape, queryable by sample name (``..._total`` for counters)."""

    def __init__(self, samples: Iterable[Sample], types: dict[str, str] | None = None) -> None:
        self.samples = list(samples)
        self.types = dict(types or {})
        self._by_name: dict[str, list[Sample]] = {}
        for s in self.samples:
            self._by_name.setdefault(s.name, []).append(s)

    def has(self, name: str) -> bool:
        return name in self._by_name

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def values(self, name: str) -> list[float]:
        """The value of every label set exporting ``name`` (empty when absent)."""
        return [s.value for s in self._by_name.get(name, ())]

    def total(self, name: str) -> float:
        """Sum across label sets: the only sound aggregate for a counter; 0 when absent."""
        return float(sum(self.values(name)))

    def mean(self, name: str) -> float | None:
        """Mean across label sets, for per-step gauges (None when nothing is exported)."""
        vals = self.values(name)
        return sum(vals) / len(vals) if vals else None

    def type_of(self, name: str) -> str:
        """The family type a sample belongs to (counter, gauge, histogram...)."""
        if name in self.types:
            return self.types[name]
        for suffix in ("_total", "_sum", "_count", "_bucket", "_created"):
            if name.endswith(suffix) and name[: -len(suffix)] in self.types:
                return self.types[name[: -len(suffix)]]
        return "unknown"


def merge_snapshots(snaps: Iterable[MetricsSnapshot]) -> MetricsSnapshot:
    """Several workers' scrapes as one (their label sets differ by Dynamo's ``worker_id``)."""
    snaps = list(snaps)
    types: dict[str, str] = {}
    for snap in snaps:
        types.update(snap.types)
    return MetricsSnapshot((s for snap in snaps for s in snap.samples), types)


def parse_metrics(text: str) -> MetricsSnapshot:
    """Parse Prometheus text exposition with ``prometheus_client``'s own parser."""
    samples: list[Sample] = []
    types: dict[str, str] = {}
    try:
        for family in text_string_to_metric_families(text):
            types[family.name] = family.type
            for s in family.samples:
                samples.append(Sample(s.name, tuple(sorted(s.labels.items())), float(s.value)))
    except (ValueError, TypeError, IndexError) as exc:
        first = text.lstrip().splitlines()[0][:60] if text.strip() else ""
        raise ValueError(f"not Prometheus text exposition ({exc}); it starts with {first!r}") from None
    return MetricsSnapshot(samples, types)


def only_families(text: str, needles: Sequence[str]) -> str:
    """The exposition lines of the families whose name contains one of ``needles`` (their samples and
    their ``# HELP`` / ``# TYPE`` lines): a worker's page holds hundreds of histogram lines a check does
    not read, and parsing them all took most of a per-request scrape."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            name = parts[2] if len(parts) > 2 else ""
        else:
            name = line.split("{", 1)[0].split(None, 1)[0] if line.strip() else ""
        if name and any(n in name for n in needles):
            keep.append(line)
    return "\n".join(keep) + "\n"


def scrape(url: str, *, timeout: float = 5.0, only: Sequence[str] | None = None) -> MetricsSnapshot:
    """GET ``url`` and parse it (``only``: the families whose name contains one of these, see
    :func:`only_families`); failures become one-line :class:`UsageError` messages."""
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"metrics URL must start with http:// or https://, got {url!r}")
    try:
        resp = requests.get(url, timeout=timeout)
    except requests.ConnectionError:
        raise UsageError(f"cannot reach {url}: connection refused or host unreachable") from None
    except requests.Timeout:
        raise UsageError(f"cannot reach {url}: no answer within {timeout:g} s") from None
    except requests.RequestException as exc:
        raise UsageError(f"cannot scrape {url}: {type(exc).__name__}") from None
    if resp.status_code != 200:
        raise UsageError(f"{url} answered HTTP {resp.status_code}, not 200")
    return parse_metrics(resp.text if only is None else only_families(resp.text, only))


@dataclass(frozen=True)
class SpecDecodeWindow:
    """Speculative-decoding activity of one worker between two scrapes."""

    verify_calls: float
    generation_tokens: float
    finished_requests: float
    accept_lengths: tuple[float, ...]
    """``spec_accept_length`` readings taken right after a request that ran verify steps."""
    accept_rate: float | None

    @property
    def accept_length(self) -> float | None:
        """Tokens per verify step from the gauge: mean of the fresh readings."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else None

    @property
    def tokens_per_verify(self) -> float | None:
        """Counter cross-check: ``(Δgen − Δfinished) / Δverify`` (drops each prefill hand-off token)."""
        if self.verify_calls <= 0:
            return None
        return (self.generation_tokens - self.finished_requests) / self.verify_calls

    @property
    def naive_tokens_per_verify(self) -> float | None:
        """``Δgen / Δverify``: biased upward by each request's prefill hand-off token (5-token
        outputs at zero acceptance give 1.25). Reported only to show why it is not used."""
        return None if self.verify_calls <= 0 else self.generation_tokens / self.verify_calls


def spec_window(before: MetricsSnapshot, after_each: Sequence[MetricsSnapshot]) -> SpecDecodeWindow:
    """The window from ``before`` to the last of ``after_each`` (one scrape after each request).

    A gauge reading is kept only if the verify counter moved since the previous scrape: the
    counter is bumped when a request finishes, and that request's verify forwards refreshed
    the gauge, so the reading is that request's own and not a stale value.
    """
    if not after_each:
        raise ValueError("spec_window needs at least one scrape after the window starts")
    after = after_each[-1]
    readings: list[float] = []
    prev = before
    for snap in after_each:
        gauge = snap.mean(SPEC_ACCEPT_LENGTH)
        if snap.total(SPEC_VERIFY_CALLS) > prev.total(SPEC_VERIFY_CALLS) and gauge is not None:
            readings.append(gauge)
        prev = snap
    return SpecDecodeWindow(
        verify_calls=after.total(SPEC_VERIFY_CALLS) - before.total(SPEC_VERIFY_CALLS),
        generation_tokens=after.total(GENERATION_TOKENS) - before.total(GENERATION_TOKENS),
        finished_requests=after.total(FINISHED_REQUESTS) - before.total(FINISHED_REQUESTS),
        accept_lengths=tuple(readings),
        accept_rate=after.mean(SPEC_ACCEPT_RATE),
    )


def verify_failures(window: SpecDecodeWindow) -> list[str]:
    """Why ``window`` shows no verify step on decode (assertion 3; empty list = it ran some)."""
    if window.verify_calls > 0:
        return []
    return [f"Δ{SPEC_VERIFY_CALLS} = {window.verify_calls:g}: decode ran no verify step "
            "(speculation off after the hand-off, or metrics not enabled on decode)"]


def accept_failures(window: SpecDecodeWindow, minimum: float = MIN_TOKENS_PER_VERIFY) -> list[str]:
    """Why ``window`` does not show accepted drafts (assertion 4; empty list = it does).

    Both the gauge and the counter cross-check must exceed ``minimum``: the gauge alone is one
    verify step per request, the counters alone cannot see acceptance directly. The naive
    ``Δgeneration_tokens / Δverify`` is never used (:attr:`SpecDecodeWindow.naive_tokens_per_verify`).
    """
    if window.verify_calls <= 0:
        return ["no verify step in the window, so no acceptance to measure"]
    out: list[str] = []
    if window.accept_length is None:
        out.append(
            f"{SPEC_ACCEPT_LENGTH} never refreshed during the window: start decode with "
            "--enable-metrics --decode-log-interval 1"
        )
    elif window.accept_length <= minimum:
        out.append(
            f"{SPEC_ACCEPT_LENGTH} = {window.accept_length:.3f} tokens per verify step, "
            f"not > {minimum:g} (draft tokens are not being accepted)"
        )
    tpv = window.tokens_per_verify
    if tpv is not None and tpv <= minimum:
        out.append(
            f"(Δgeneration_tokens − Δfinished requests) / Δverify calls = "
            f"({window.generation_tokens:g} − {window.finished_requests:g}) / {window.verify_calls:g} "
            f"= {tpv:.3f}, not > {minimum:g}"
        )
    return out
