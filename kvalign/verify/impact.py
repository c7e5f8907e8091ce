"""What a finding does to routing: its class, its bound, and whether the real router's choice changes.

A cache-blind finding (keys, card or events disagree) loses or invents credit without bound; a
credit skew (keys agree; an engine rule or a router weight makes the credit differ) is bounded by the
installed packages' own constants. ``check`` fails only on the first kind (:func:`blocking`), so
that a red build means routing went cache-blind. For ``HOST_CREDIT_NOT_SERVABLE`` the bound is read
from SGLang's ``UnifiedRadixCache.init_hicache`` (``load_back_threshold``: a host-only stretch
shorter than it is re-prefilled) and from the router's configured ``host_cache_hit_weight``; the
routing impact is measured, not argued: the counterexample's engine state (SGLang's real cache with
HiCache, served by its scheduler code) is one candidate of a real ``KvRouter``
(:class:`~kvalign.oracles.router_pair.RouterPair`), a second candidate holds the same prompt's first
``k`` pages on device, and for every ``k`` the router's own ``best_worker`` is held against what each
engine then reuses (SGLang's ``cached_tokens``). The choice *changes* where the router picks the
candidate that reuses strictly less.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvalign.model.causes import CACHE_BLIND, CREDIT_SKEW, Cause, cause_class
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.rows import RowResult

#: Past the prompt's cached pages, the counterexample's prompt goes on by this many tokens (SGLang caps a
#: match below the last token, so the cached pages are all matchable).
TAIL = 1


def row_class(r: RowResult) -> str | None:
    """A row's class: None for a row that ran clean, did not run (``n/a``) or is unconfirmed, else its cause's class."""
    if r.skipped or r.ok or r.unconfirmed:
        return None
    return cause_class(r.cause_name or Cause.UNKNOWN.name)


def blocking(rows: Sequence[RowResult], strict: bool = False) -> list[RowResult]:
    """The rows that fail ``check``: cache-blind findings, or (``--strict``) every finding."""
    return [r for r in rows if row_class(r) is not None and (strict or row_class(r) == CACHE_BLIND)]


def advisories(rows: Sequence[RowResult]) -> list[RowResult]:
    return [r for r in rows if row_class(r) == CREDIT_SKEW]


@dataclass(frozen=True)
class SkewBound:
    """How far the router's host credit can exceed what SGLang serves, per request, from the packages' constants."""

    threshold: int  # SGLang's load_back_threshold, KV slots
    weight: float  # the router's host_cache_hit_weight
    page_size: int

    @property
    def host_pages(self) -> int:
        """Host-only pages SGLang can decline: a stretch is whole pages, declined when shorter than the threshold."""
        return (self.threshold - 1) // self.page_size

    @property
    def tokens(self) -> int:
        """KV slots of the longest declined stretch (the router credits them, the engine re-prefills them)."""
        return self.host_pages * self.page_size

    @property
    def credit_blocks(self) -> float:
        return self.host_pages * self.weight

    def says(self) -> str:
        if not self.host_pages:
            return f"none at page size {self.page_size} (>= SGLang's load_back_threshold {self.threshold})"
        return (f"at most {self.tokens} host slots per request at page size {self.page_size} ({self.host_pages} "
                f"page(s) x host weight {self.weight:g} = {self.credit_blocks:g} blocks of credit; SGLang's "
                f"load_back_threshold {self.threshold}: at most {self.threshold - 1} at any page size, none at "
                f"page size >= {self.threshold})")


@dataclass
class Trial:
    """One ``k``: the other candidate holds the prompt's first ``k`` pages on device."""

    k: int
    chosen: int  # the rank the router picked (0: the counterexample's engine)
    reused: tuple[int, int]  # what each candidate's engine reused of the prompt, in tokens

    @property
    def changed(self) -> bool:
        other = 1 - self.chosen
        return self.reused[other] > self.reused[self.chosen]


@dataclass
class RoutingImpact:
    """The real router's choices on a counterexample's state against another candidate's device prefix."""

    page_size: int
    eagle: bool
    device_pages: int
    host_pages: int
    prompt_tokens: int
    trials: list[Trial] = field(default_factory=list)

    @property
    def changes_worker(self) -> bool:
        return any(t.changed for t in self.trials)

    def says(self) -> str:
        state = (f"page size {self.page_size}{' (EAGLE)' if self.eagle else ''}, {self.prompt_tokens}-token prompt, "
                 f"one candidate holding {self.device_pages} page(s) on device + {self.host_pages} on host only")
        flips = [t for t in self.trials if t.changed]
        if flips:
            t = flips[0]
            return (f"changes the worker: {state}; with the other holding {t.k} page(s) on device the router picks "
                    f"the first, which reuses {t.reused[0]} tokens where the other would reuse {t.reused[1]}")
        ks = ", ".join(f"k={t.k}: picks {'first' if t.chosen == 0 else 'other'} ({t.reused[0]} vs {t.reused[1]} reused)"
                       for t in self.trials)
        return f"does not change the worker: {state}; other candidate holding k pages on device: {ks}"


def _counterexample_steps(device: int, host: int, p: int, eagle: bool) -> list[tuple[Any, ...]]:
    """Requests that leave ``device`` pages on device and ``host`` more on host only (as the servable worked case):
    cache the device stretch, then the whole stretch, back it up, then evict the leaf's pages from device."""
    extra = int(eagle)  # bigram keys: a page of p slots needs p + 1 tokens
    whole = [1 + (i % 3) for i in range((device + host) * p + extra)]
    steps: list[tuple[Any, ...]] = []
    if device:
        steps += [("request", whole[: device * p + extra]), ("transfers_done",)]
    steps += [("request", whole), ("transfers_done",), ("evict_device", host * p)]
    return steps


def measure_routing(page_size: int, eagle: bool, device_pages: int, host_pages: int, *, path: Any,
                    make_engine: Callable[..., Any] | None = None) -> RoutingImpact:
    """For k = 0 .. device + host pages: the router's choice between the counterexample's engine (rank 0)
    and an engine holding the prompt's first k pages on device (rank 1), and what each engine reuses."""
    from kvalign.oracles.hicache import HiCacheEngine
    from kvalign.oracles.router_pair import RouterPair

    make = make_engine or HiCacheEngine
    p, extra = page_size, int(eagle)
    pair = RouterPair(path, p, eagle)
    steps = _counterexample_steps(device_pages, host_pages, p, eagle)
    body = list(steps[-3][1])
    impact = RoutingImpact(p, eagle, device_pages, host_pages, len(body) + TAIL)
    try:
        for k in range(device_pages + host_pages + 1):
            base = (k + 1) * 64 + (1 << 20)  # each trial in its own token range of the long-lived router
            prompt = [base + t for t in body] + [base] * TAIL
            engines = [make(p, eagle=eagle, core="unified", policy="write_through", host_tokens=1 << 20) for _ in (0, 1)]
            a, b = engines
            for step in steps:
                if step[0] == "request":
                    a.serve([base + t for t in step[1]])
                elif step[0] == "transfers_done":
                    a.transfers_done()
                else:
                    a.evict(step[1])
            held = a.residency(prompt)
            if (held.device, held.host) != (device_pages, host_pages):
                raise RuntimeError(f"the counterexample's state did not replay: SGLang holds {held.device} device + "
                                   f"{held.host} host pages, not {device_pages} + {host_pages}")
            if k:
                b.serve(prompt[: k * p + extra])
                b.transfers_done()
            for rank, engine in enumerate(engines):
                pair.publish(rank, engine.take_raw_events())
            pair.settle(prompt, {0: (device_pages, host_pages), 1: (k, 0)})
            chosen = pair.choice(prompt)
            reused = (a.serve(prompt).cached_tokens, b.serve(prompt).cached_tokens)
            impact.trials.append(Trial(k, chosen, reused))
    finally:
        pair.close()
    return impact


@dataclass
class StorageImpact:
    """The real router's choices when one candidate holds a prompt's pages only in HiCache's storage tier."""

    page_size: int
    eagle: bool
    storage_pages: int
    shared: bool  # the other candidate refills from the same storage directory (False: its own, empty)
    trials: list[Trial] = field(default_factory=list)

    @property
    def changes_worker(self) -> bool:
        return any(t.changed for t in self.trials)

    def says(self) -> str:
        where = ("both candidates on one storage directory (the file backend's shared dir; a Mooncake store)"
                 if self.shared else "each candidate on its own storage directory (as `e2e fuzz --storage file` runs)")
        state = (f"page size {self.page_size}{' (EAGLE)' if self.eagle else ''}, one candidate holding "
                 f"{self.storage_pages} page(s) in storage only, {where}")
        flips = [t for t in self.trials if t.changed]
        if flips:
            t = max(flips, key=lambda t: t.reused[1 - t.chosen] - t.reused[t.chosen])  # the largest loss
            picked = "it" if t.chosen == 1 else "the first"
            return (f"changes the worker for {len(flips)} of {len(self.trials)} k: {state}; with the other holding {t.k} "
                    f"page(s) on device the router picks {picked}, which reuses {t.reused[t.chosen]} tokens where the "
                    f"{'first' if t.chosen == 1 else 'other'} would reuse {t.reused[1 - t.chosen]}")
        ks = ", ".join(f"k={t.k}: picks {'first' if t.chosen == 0 else 'other'} ({t.reused[0]} vs {t.reused[1]} reused)"
                       for t in self.trials)
        return f"does not change the worker: {state}; other candidate holding k pages on device: {ks}"


def measure_storage_routing(page_size: int, eagle: bool, storage_pages: int, *, shared: bool, path: Any,
                            make_engine: Callable[..., Any] | None = None) -> StorageImpact:
    """For k = 0 .. storage_pages: the router's choice between an engine holding the prompt's pages only in
    storage (rank 0: cached, written through, evicted from device and host) and one holding its first k pages
    on device (rank 1), on a storage directory of its own or the same one; what each then reuses is SGLang's
    own answer (its prefetch from storage, then its scheduler's admission: ``cached_tokens``)."""
    from kvalign.oracles.router_pair import RouterPair
    from kvalign.oracles.storage import StorageEngine

    make = make_engine or StorageEngine
    p, extra = page_size, int(eagle)
    pair = RouterPair(path, p, eagle)
    impact = StorageImpact(p, eagle, storage_pages, shared)
    try:
        for k in range(storage_pages + 1):
            base = (k + 1) * 64 + (2 << 20)  # each trial in its own token range of the long-lived router
            prompt = [base + 1 + (i % 3) for i in range(storage_pages * p + extra)] + [base] * TAIL
            a = make(p, eagle=eagle)
            try:
                b = make(p, eagle=eagle, storage_dir=a.storage_dir if shared else None)
                try:
                    a.insert(prompt)
                    if not a.pump():
                        raise RuntimeError("SGLang's storage writes did not finish")
                    a.evict(1 << 16)
                    a.evict_host(1 << 16)
                    held = a.tiers(prompt)
                    if (held.device, held.host, held.storage) != (0, 0, storage_pages):
                        raise RuntimeError(f"the storage-only state did not build: SGLang holds {held}")
                    if k:
                        b.insert(prompt[: k * p + extra])
                        b.pump()
                    for rank, engine in enumerate((a, b)):
                        pair.publish(rank, engine.take_raw_events())
                    pair.settle(prompt, {0: (0, 0), 1: (k, 0)})
                    chosen = pair.choice(prompt)
                    reused = []
                    for engine in (a, b):
                        engine.refill(prompt)
                        reused.append(engine.serve(prompt).cached_tokens)
                    impact.trials.append(Trial(k, chosen, (reused[0], reused[1])))
                finally:
                    b.close()  # the second engine first: the first's close gives back what was pinned after it
            finally:
                a.close()
    finally:
        pair.close()
    return impact


def assess_storage(r: RowResult, path: Any) -> None:
    """A STORAGE_TIER_UNCREDITED row: the routing impact at its counterexample's page size and refilled pages,
    with storage private to each worker and shared by both (the class stays cache-blind: no constant bounds the
    lost credit; whether the choice changes depends on whether the workers share the storage tier)."""
    ex = r.counterexample or {}
    missing = [k for k in ("page_size", "uncredited_pages") if ex.get(k) is None]
    if missing:
        raise ValueError(f"{r.prop}/{r.mode}/{r.variant}: the counterexample has no {', '.join(missing)}")
    p, n, eagle = int(ex["page_size"]), int(ex["uncredited_pages"]), r.mode == "eagle"
    private = measure_storage_routing(p, eagle, n, shared=False, path=path)
    shared = measure_storage_routing(p, eagle, n, shared=True, path=path)
    r.changes_worker = private.changes_worker or shared.changes_worker
    why = (" (on one tier only through SGLang's load_back_threshold: the candidate holding the device prefix refills "
           "the rest from storage, and a remainder below the threshold is declined and re-prefilled)"
           if shared.changes_worker else "")
    r.impact = (f"no constant bound (the pages SGLang refills and loads back: up to the prompt's pages in storage); "
                f"the router {private.says()}; the router {shared.says()}{why}")


def assess(rows: Sequence[RowResult], router_path: Callable[[], Any] | None = None) -> None:
    """Fill each finding row's class, and for a credit skew its bound and measured routing impact.

    ``router_path()``: the run's own router path (``check`` measures on the path of the process that ran
    the rows, which closes it); None opens one for the call."""
    skews = [r for r in rows if row_class(r) == CREDIT_SKEW]
    storage = [r for r in rows if r.cause_name == Cause.STORAGE_TIER_UNCREDITED.name]
    for r in rows:
        r.finding_class = row_class(r)
    if not skews and not storage:
        return
    if router_path is None:
        from kvalign.oracles.router_path import RouterPath

        path = RouterPath()
    else:
        path = router_path()
    try:
        measured: dict[tuple[Any, ...], RoutingImpact] = {}
        measures = [(r, lambda r=r: assess_skew(r, path, measured)) for r in skews]
        measures += [(r, lambda r=r: assess_storage(r, path)) for r in storage]
        for r, measure in measures:
            try:
                measure()
            except OracleUnavailable as exc:  # a release whose router cannot be set up for the measurement (1.3.1)
                r.impact = f"routing impact not measured: {exc}"
    finally:
        if router_path is None:
            path.close()


def assess_skew(r: RowResult, path: Any, measured: dict[tuple[Any, ...], RoutingImpact]) -> None:
    """A HOST_CREDIT_NOT_SERVABLE row: bound at its counterexample's page size, routing impact measured there."""
    a = r.admission or {}
    missing = [k for k in ("page_size", "device_tokens", "host_only_tokens", "load_back_threshold") if a.get(k) is None]
    if missing:
        raise ValueError(f"{r.prop}/{r.mode}/{r.variant}: the counterexample's admission has no {', '.join(missing)}")
    p, eagle = int(a["page_size"]), r.mode == "eagle"
    bound = SkewBound(int(a["load_back_threshold"]), path.host_weight, p)
    key = (p, eagle, int(a["device_tokens"]) // p, int(a["host_only_tokens"]) // p)
    if key not in measured:
        measured[key] = measure_routing(p, eagle, key[2], key[3], path=path)
    impact = measured[key]
    r.bound_tokens, r.changes_worker = bound.tokens, impact.changes_worker
    worst = (p, eagle, 1, bound.host_pages)
    if worst != key and bound.host_pages:
        if worst not in measured:
            measured[worst] = measure_routing(p, eagle, 1, bound.host_pages, path=path)
        r.impact = (f"bound: {bound.says()}; on the counterexample the router {measured[key].says()}; at the bound "
                    f"the router {measured[worst].says()}")
    else:
        r.impact = f"bound: {bound.says()}; on the counterexample the router {impact.says()}"
