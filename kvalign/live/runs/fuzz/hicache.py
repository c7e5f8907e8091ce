"""The fuzz with SGLang's host tier (HiCache) on: what the router and the engine say per tier.

With ``--hicache`` every publishing worker runs SGLang's real HiCache (:mod:`kvalign.live.engines.hicache`),
and each request is read on both sides per tier (measured on Dynamo 1.6.1 x SGLang 0.5.23, page 4):

* **the router**: ``kv_hit_rate = (device + w * host) / ceil(N / B)`` with ``w`` its
  ``host_cache_hit_weight`` (0.75; a host-only stretch of 5 blocks of a 21-token prompt reported
  0.625), and the frontend's counter ``router_kv_selected_cached_prefix_tokens_total`` rises by
  ``(device + host) * B``, the raw tokens credited on the chosen worker. From the two, the one
  (device, host) pair the router credited (:func:`router_tiers`); the router's *tokens* are the raw
  credit (what it says the worker holds for the prompt).
* **the engine**: ``usage.prompt_tokens_details.cached_tokens`` (device prefix + the host tokens it
  loaded back) and SGLang's own split, the worker's ``sglang:cached_tokens_total{cache_source}``
  delta (``device`` / ``host``); its KV events with ``medium`` give the residency
  (:mod:`.tiers`).

SGLang's scheduler matches at most ``N - 1`` tokens of a prompt (``N - 2`` bigrams under EAGLE), and
loads a host-only stretch back only when it is at least ``load_back_threshold`` tokens
(:data:`LOAD_BACK_THRESHOLD`); a declined stretch is re-prefilled, which is no reuse. So on a
request with residency (d, h) pages and the cap at c pages, the engine reuses ``B * min(d, c)``
device tokens plus either all ``B * min(h, c - min(d, c))`` host tokens or none: what the engine
view predicts and its split must show (``engine_matches_index``), and what the router must
credit (``router_credits_engine_reuse``: a declined stretch the router credited is
``HOST_CREDIT_NOT_SERVABLE``). ``router_tiers_match_engine`` holds the router's (device, host) to
the engine's residency.

With a storage tier (``--storage file``) SGLang's split has a third source, ``storage``: pages it
refilled from L3 after the request arrived (its prefetch), which no event named at the routing mark
(SGLang publishes nothing for a page held only in storage; the refill publishes host stores
afterwards). The engine view therefore expects its events' device and host reuse *plus* the
storage tokens SGLang's own split reports (:attr:`TierObservation.storage`), and the split must add
up to the reported reuse, or the surface is missing. The router credits what the events said, so a
refill the router did not credit fails ``router_credits_engine_reuse`` with the cause
``STORAGE_TIER_UNCREDITED`` when the storage tokens account for the whole shortfall
(:func:`cause`): what ``check --property storage`` finds in-process, on the live engine.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from kvalign.errors import UsageError
from kvalign.live.runs.fuzz.invariants import Observation, Tally
from kvalign.live.runs.fuzz.surfaces import SurfaceMissing
from kvalign.live.runs.fuzz.tiers import DEVICE, HOST, Residency, TierIndex
from kvalign.live.runs.fuzz.views import engine_reusable_pages
from kvalign.live.wire.metrics import MetricsSnapshot, scrape
from kvalign.model.causes import Cause
from kvalign.model.events import BlockRemoved
from kvalign.model.hashing import U64_MASK
from kvalign.model.relay import RELAY_TIERS

#: SGLang 0.5.23's ``UnifiedRadixCache.init_hicache``: ``self.load_back_threshold = 10`` (held against the
#: installed SGLang by ``tests/unit/live/test_live_fuzz_hicache.py``). Used to sort host re-queries into
#: below / above the threshold and to say what the servable property predicts; never to judge.
LOAD_BACK_THRESHOLD = 10
#: The frontend's raw credit counter (Dynamo 1.6.1 ``prometheus_names``: ``router_kv_selected_cached_prefix_tokens_total``).
SELECTED = "router_kv_selected_cached_prefix_tokens_total"
#: SGLang's per-tier reuse counter, by ``cache_source``.
ENGINE_CACHED = "sglang:cached_tokens_total"
COUNTS = ("evicted_to_host", "host_requeried", "loaded_back", "host_evicted_requeried")
#: With a storage tier: requests SGLang served partly from storage, the pages it refilled for them, and
#: the ``refill_storage`` steps whose prompt had left device and host when it was asked for again.
STORAGE_COUNTS = ("storage_requeried", "storage_refilled_pages", "storage_evicted_requeried")
INVARIANT = "router_tiers_match_engine"
#: The order a HiCache request's invariants are evaluated in (the first failure names the run's):
#: :func:`kvalign.live.runs.fuzz.invariants.evaluate`'s, with the tier check after the credit check, and
#: the data-parallel rank check last, where :meth:`~kvalign.live.runs.fuzz.dp_ranks.DpRanks.judge` appends it.
EVALUATION_ORDER = ("engine_matches_index", "router_credits_engine_reuse", INVARIANT, "router_matches_prediction",
                    "no_stale_credit", "best_worker_chosen", "decode_keeps_speculating", "kv_transferred",
                    "routers_agree", "routed_rank_served")


def weighted(r: Residency, weight: float) -> float:
    """The overlap the router ranks workers by: device blocks plus ``weight`` per host-only block."""
    return r.device + weight * r.host


def host_weight() -> float:
    """The router's ``host_cache_hit_weight`` default, read from the installed binding's signature."""
    from dynamo._core import KvRouterConfig

    found = re.search(r"host_cache_hit_weight=([0-9.]+)", KvRouterConfig.__text_signature__ or "")
    if found is None:
        raise UsageError("this Dynamo's KvRouterConfig has no host_cache_hit_weight: its router has no host tier")
    return float(found.group(1))


def router_tiers(raw_tokens: float | None, kv_hit_rate: float | None, n_tokens: int, block_size: int,
                 weight: float) -> tuple[int, int] | None:
    """The (device, host) blocks the router credited: the one split of its raw credit
    (``raw_tokens / B`` blocks) whose weighted sum over ``ceil(N / B)`` is the reported rate.
    Splits differ by ``(1 - w) / ceil(N / B)`` in rate, so the match is unique; None when no split
    fits (a router reporting another formula, or a counter that did not move as credited)."""
    if raw_tokens is None or kv_hit_rate is None or raw_tokens % block_size:
        return None
    blocks, isl = int(raw_tokens) // block_size, math.ceil(n_tokens / block_size)
    if isl == 0:
        return None
    fits = [(blocks - h, h) for h in range(blocks + 1)
            if math.isclose((blocks - h + weight * h) / isl, kv_hit_rate, rel_tol=0, abs_tol=1e-9)]
    return fits[0] if len(fits) == 1 else None


@dataclass
class TierObservation(Observation):
    """An :class:`Observation` of a request to a worker with HiCache on, read per tier."""

    residency: Residency = field(default_factory=Residency)  # engine view at the routing mark
    router_view: Residency = field(default_factory=Residency)  # router view (delivered batches) at the mark
    router_raw: float | None = None  # the router's raw credited tokens (its counter's delta)
    weight: float = 0.75  # the router's host weight
    engine_split: tuple[int, int] | None = None  # (device, host) tokens the engine reported reusing
    storage: int | None = None  # tokens the engine reported refilling from storage (None: no storage tier)

    @property
    def router_split(self) -> tuple[int, int] | None:
        return router_tiers(self.router_raw, self.completion.kv_hit_rate, self.n, self.block_size, self.weight)

    @property
    def credited(self) -> int | None:
        split = self.router_split
        return None if split is None else sum(split)

    def capped(self) -> tuple[int, int]:
        """(device, host-only) pages of the residency inside the scheduler's cap."""
        cap = engine_reusable_pages(self.n, self.block_size, eagle=self.engine_eagle)
        d = min(self.residency.device, cap)
        return d, min(self.residency.host, cap - d)

    @property
    def loaded(self) -> int:
        """Host tokens the engine loaded back (its own split)."""
        return 0 if self.engine_split is None else self.engine_split[1]

    def cached_expected(self) -> int:
        """SGLang's reuse for this residency: the capped device prefix, plus the capped host stretch
        when the engine's split says it loaded it (all of it, or the request does not match)."""
        d, h = self.capped()
        b = self.block_size
        return b * d + (b * h if self.loaded else 0) + (self.storage or 0)

    @property
    def declined(self) -> bool:
        """A host-only stretch inside the cap that the engine did not load back."""
        return self.capped()[1] > 0 and self.engine_split is not None and self.loaded == 0

    def numbers(self) -> str:
        d, h = self.capped()
        split = self.router_split
        return (super().numbers() + f"; router tiers {split} (device, host blocks; raw {self.router_raw} tokens, "
                f"host weight {self.weight}), engine residency {self.residency.device} device + {self.residency.host} "
                f"host-only pages ({d} + {h} inside the scheduler's cap), engine split {self.engine_split} "
                "(device, host tokens)" + ("" if self.storage is None else f" + {self.storage} storage tokens (refilled "
                                           "from L3, in no event at the routing mark)"))


def evaluate_tiers(obs: TierObservation, tally: Tally) -> list[tuple[str, str]]:
    """``router_tiers_match_engine``: the router's (device, host) credit equals the engine view's
    residency; on a request whose batches the hop lost on purpose (``hop_faulted``), the residency
    the router was told (the router view), as ``router_matches_prediction`` judges the total."""
    if obs.label is None:
        return []
    tally.checked[INVARIANT] += 1
    told = obs.router_view if obs.hop_faulted else obs.residency
    split, want = obs.router_split, (told.device, told.host)
    if split == want:
        return []
    tally.failed[INVARIANT] += 1
    where = "the batches the hop delivered hold" if obs.hop_faulted else "the engine's events hold"
    return [(INVARIANT, f"router credited {split} (device, host) blocks, {where} {want}; {obs.numbers()}")]


def cause(obs: Observation) -> str | None:
    """The HiCache cause of a failure on ``obs``, when it has one."""
    if not isinstance(obs, TierObservation):
        return None
    if storage_uncredited(obs):
        return Cause.STORAGE_TIER_UNCREDITED.name
    if obs.declined and obs.router_tokens is not None and obs.engine_tokens is not None \
            and obs.router_tokens > obs.engine_tokens:
        return Cause.HOST_CREDIT_NOT_SERVABLE.name
    split = obs.router_split
    if split is not None and sum(split) == obs.residency.held and split != (obs.residency.device, obs.residency.host):
        return Cause.TIER_RESIDENCY.name
    return None


def storage_uncredited(obs: TierObservation) -> bool:
    """The router credited less than the engine reused, and the pages SGLang refilled from storage
    account for the whole shortfall: they were in no tier the router indexes when it routed."""
    rt, et = obs.router_tokens, obs.engine_tokens
    return bool(obs.storage) and rt is not None and et is not None and 0 < et - rt <= (obs.storage or 0)


def requery_record(obs: TierObservation) -> dict[str, Any]:
    """One host re-query, as SGLang reported it, beside what the servable property predicts."""
    d, h = obs.capped()
    b = obs.block_size
    return {"request": obs.request, "prompt_tokens": obs.n, "device_tokens": b * d, "host_only_tokens": b * h,
            "loaded_tokens": obs.loaded, "router_tokens": obs.router_tokens, "engine_tokens": obs.engine_tokens,
            "threshold_predicts": "load" if b * h >= LOAD_BACK_THRESHOLD else "decline",
            "engine_did": "load" if obs.loaded else "decline"}


class EngineTiers:
    """SGLang's per-tier reuse counter on each publishing worker (its /metrics)."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = dict(urls)

    def snapshot(self, label: str) -> dict[str, float] | None:
        """``label``'s counter by ``cache_source`` (None while it has no sample: SGLang's
        multiprocess metrics export a counter only once something was counted)."""
        try:
            snap = scrape(self.urls[label])
        except UsageError as exc:
            raise SurfaceMissing(str(exc)) from None
        return by_label(snap, ENGINE_CACHED, "cache_source") if snap.has(ENGINE_CACHED) else None

    def snapshots(self) -> dict[str, dict[str, float] | None]:
        return {label: self.snapshot(label) for label in self.urls}

    def split(self, label: str, before: dict[str, float] | None, after: dict[str, float] | None,
              engine_tokens: int | None) -> tuple[int, int]:
        """(device, host) tokens ``label`` reported reusing between two snapshots. A worker that
        reused tokens but exports no counter is a missing surface, never a split of 0."""
        if after is None:
            if engine_tokens:
                raise SurfaceMissing(f"{self.urls[label]} exports no {ENGINE_CACHED} after reusing {engine_tokens} "
                                     "tokens: SGLang's per-tier reuse (device / host) cannot be read")
            return 0, 0
        was = before or {}
        return (round(after.get("device", 0) - was.get("device", 0)), round(after.get("host", 0) - was.get("host", 0)))

    def storage(self, label: str, before: dict[str, float] | None, after: dict[str, float] | None,
                engine_tokens: int | None) -> int:
        """Tokens ``label`` reported refilling from storage between two snapshots. SGLang counts a
        source only when it is above 0, so a storage count of 0 is read only where the split it belongs
        to is there and adds up: device + host + storage must equal the reported reuse, else the
        surface is missing (never a refill of 0)."""
        device, host = self.split(label, before, after, engine_tokens)
        was = before or {}
        storage = round((after or {}).get("storage", 0) - was.get("storage", 0))
        if engine_tokens is not None and device + host + storage != engine_tokens:
            raise SurfaceMissing(f"{self.urls[label]}'s {ENGINE_CACHED} moved by device {device} + host {host} + "
                                 f"storage {storage} tokens, but the worker reported reusing {engine_tokens}: SGLang's "
                                 "per-tier split (storage included) cannot be read for this request")
        return storage


def by_label(snap: MetricsSnapshot, name: str, key: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in snap.samples:
        if s.name == name:
            v = dict(s.labels).get(key, "")
            out[v] = out.get(v, 0.0) + s.value
    return out


def selected_tokens(snap: MetricsSnapshot) -> float | None:
    """The frontend's raw credit counter on the publishing workers (every worker; the aggregated or
    prefill phase, not the decode hop's), None before it exists."""
    found = [s.value for s in snap.samples if s.name.removesuffix("_total").endswith(SELECTED.removesuffix("_total"))
             and dict(s.labels).get("phase") != "decode"]
    return float(sum(found)) if found else None


class RouterCredit:
    """The frontend's raw credit counter around one request sent alone."""

    def __init__(self, frontend_metrics_url: str) -> None:
        self.url = frontend_metrics_url

    def now(self, *, required: bool) -> float:
        try:
            value = selected_tokens(scrape(self.url))
        except UsageError as exc:
            raise SurfaceMissing(str(exc)) from None
        if value is None and required:
            raise SurfaceMissing(f"{self.url} exports no {SELECTED} after a routed request: the router's raw credit "
                                 "per tier cannot be read")
        return value or 0.0


def storage_pages(tokens: int, block_size: int) -> int:
    """Pages a storage refill of ``tokens`` covers (SGLang refills whole pages; the cap may clip the last)."""
    return -(-tokens // block_size)


def tier_counts(batches_by_label: dict[str, list[Any]], block_size: int) -> dict[str, int]:
    """Pages the engines moved to host: a device removal of a page whose host copy was held."""
    moved = 0
    for batches in batches_by_label.values():
        idx = TierIndex(block_size)
        for batch in batches:
            for ev in batch.events:
                if isinstance(ev, BlockRemoved) and RELAY_TIERS.get(ev.medium) == DEVICE:
                    moved += sum(1 for h in ev.block_hashes if HOST in getattr(idx.by_hash.get(h & U64_MASK), "tiers", ()))
                idx.apply(ev)
    return {"evicted_to_host": moved}
