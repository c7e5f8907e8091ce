"""Where the fuzz reads what a worker really did, per request, from stable surfaces only.

* **Engine reuse.** An aggregated worker reports its own reuse in the response:
  ``usage.prompt_tokens_details.cached_tokens``. In prefill/decode disaggregation that field is the
  decode hop's count (0 on the CPU path), so the prefill worker's reuse is read where Dynamo keeps
  it: ``dynamo.sglang`` sends ``engine_data.kv_cache_hit = {prompt_tokens, reused_tokens}`` from the
  prefill attempt, and the frontend adds ``reused_tokens`` to the counter
  ``..._router_kv_worker_reused_tokens_total{phase="prefill"}``. The delta of that counter across a
  request sent alone is that request's prefill reuse.
* **What the router's index applied.** The frontend counts every KV event its router's index
  applied, ``..._kv_cache_events_applied{dynamo_component, event_type, status}``: one per
  ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` the relay received (measured on
  1.6.1: equal to the router-side capture's events, request by request, stores and evictions, a
  batch's chained stores and its consecutive removals counted once: :func:`applied_units`).
  Settling waits on it, because the router-side capture shows what reached Dynamo's relay, not
  what the router's index has applied.
* **Decode speculation.** ``dynamo.sglang`` leaves ``completion_tokens_details`` empty, so the
  decode worker's SGLang counters are read before and after a window of requests sent alone
  (:func:`kvalign.live.wire.metrics.spec_window`, :mod:`.speculation`).

A surface that is missing is an environment error naming it (exit 2), never a skipped check.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvalign.errors import UsageError
from kvalign.model.events import BlockRemoved, BlockStored
from kvalign.live.cluster.shared import EVENTS_APPLIED, events_applied
from kvalign.live.wire.metrics import MetricsSnapshot, scrape

#: The frontend's counter of what prefill workers reported reusing (Dynamo 1.6.1's
#: ``prometheus_names``: ``router_kv_worker_reused_tokens_total``, prefixed ``dynamo_component_``).
PREFILL_REUSED = "router_kv_worker_reused_tokens_total"


def applied_units(events: Sequence[object]) -> int:
    """How many ``kv_cache_events_applied`` one batch of engine events makes on Dynamo 1.6.1's frontend:
    one per event, except where Dynamo merges an event into the one just before it in the same batch
    (its relay merges mutations of one kind):

    * a ``BlockStored`` hanging under the last page of the ``BlockStored`` just before it extends that
      store (measured live: a batch of two such stores, which SGLang's publisher sends when it merges
      batches, made the counter rise by one, and the router indexed both stores' pages);
    * a ``BlockRemoved`` right after a ``BlockRemoved`` of the same medium extends that removal
      (measured live on vLLM, which publishes one removal per block: a batch of 3 removals and 2
      stores made ``event_type="removed"`` rise by one and ``"stored"`` by two, one of 9 removals and a
      store by one and one; counted one per event, every fill request's settle waited out its 8 s
      bound, 8 of them per generated vLLM run)."""
    n, last = 0, None
    for ev in events:
        chained = (isinstance(ev, BlockStored) and isinstance(last, BlockStored) and ev.parent_block_hash is not None
                   and bool(last.block_hashes) and ev.parent_block_hash == last.block_hashes[-1])
        chained = chained or (isinstance(ev, BlockRemoved) and isinstance(last, BlockRemoved)
                              and ev.medium == last.medium)
        n += not chained
        last = ev
    return n


class SurfaceMissing(RuntimeError):
    """A surface the fuzz reads per request is not there: the environment cannot run the check."""


def prefill_reused_total(snap: MetricsSnapshot) -> float | None:
    """Sum of the frontend's ``*router_kv_worker_reused_tokens_total{phase="prefill"}`` samples
    (None when the frontend exports no such counter yet: it appears with the first report)."""
    found = [s.value for s in snap.samples
             if s.name.endswith(PREFILL_REUSED) and dict(s.labels).get("phase") == "prefill"]
    return float(sum(found)) if found else None


#: The metric families the fuzz reads on each page (name substrings): every other family is skipped
#: before parsing (:func:`kvalign.live.wire.metrics.only_families`).
FRONTEND_FAMILIES = (EVENTS_APPLIED, PREFILL_REUSED)
DECODE_FAMILIES = ("sglang:spec_", "sglang:generation_tokens", "sglang:num_requests")


class MetricReader:
    """Scrapes of the frontend (prefill reuse, events applied) and of the decode workers (speculation).

    A decode worker's counters move only while it serves a request, so the scrape that closed one
    speculation window is also the next window's "before" on that worker, unless it served something
    unscraped in between (:meth:`forget`): the speculation check costs one scrape per window
    (:mod:`.speculation`), not one per worker and request."""

    def __init__(self, frontend_url: str, decode_urls: dict[str, str]) -> None:
        self.frontend_url, self.decode_urls = f"{frontend_url}/metrics", dict(decode_urls)
        self._last: dict[str, MetricsSnapshot] = {}  # decode worker -> its counters since it last served

    def _scrape(self, url: str, only: Sequence[str] | None = None) -> MetricsSnapshot:
        try:
            return scrape(url, only=only)
        except UsageError as exc:
            raise SurfaceMissing(str(exc)) from None

    def prefill_reused(self, *, before_first_report: bool = False) -> float:
        """The frontend's prefill-reuse counter now.

        The frontend exports the counter once a prefill worker has reported (each prefill attempt
        reports, 0 reused included), so it may be absent only before the request whose reuse is
        read (``before_first_report``: read as 0). Absent after a prefill request, the prefill
        worker's reuse cannot be read (a renamed or dropped metric): :class:`SurfaceMissing`,
        never a 0 that would turn into a false ``router_credits_engine_reuse`` failure."""
        total = prefill_reused_total(self._scrape(self.frontend_url, FRONTEND_FAMILIES))
        if total is not None:
            return total
        if before_first_report:
            return 0.0
        raise SurfaceMissing(f"{self.frontend_url} exports no *{PREFILL_REUSED}{{phase=\"prefill\"}} after a prefill "
                             "request: the prefill worker's reuse cannot be read (Dynamo 1.6.1's frontend counts "
                             "engine_data.kv_cache_hit there)")

    def events_applied(self, components: Sequence[str]) -> float | None:
        """KV events the frontend's router index applied for ``components``, every type and status
        (None when the frontend exports no such counter)."""
        snap = self._scrape(self.frontend_url, FRONTEND_FAMILIES)
        found = [n for c in components if (n := events_applied(snap, dynamo_component=c)) is not None]
        return float(sum(found)) if found else None

    def decode(self, labels: Sequence[str]) -> dict[str, MetricsSnapshot]:
        """Each decode worker's counters now: the last scrape where it has served nothing since."""
        for label in labels:
            if label not in self._last:
                self._last[label] = self._scrape(self.decode_urls[label], DECODE_FAMILIES)
        return {label: self._last[label] for label in labels}

    def after(self, label: str) -> MetricsSnapshot:
        """``label``'s counters now, scraped afresh after it served a request (kept as its next "before")."""
        self._last[label] = self._scrape(self.decode_urls[label], DECODE_FAMILIES)
        return self._last[label]

    def forget(self, label: str | None = None) -> None:
        """``label`` (every decode worker: None) served something no scrape followed: scrape it afresh."""
        if label is None:
            self._last.clear()
        else:
            self._last.pop(label, None)
