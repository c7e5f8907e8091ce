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
engine then reuses (SGLang's ``cached_tokens``). Each state is routed
:data:`~kvalign.oracles.router_pair.ROUTES` times: the choice *changes* where the router picks, every
time, the candidate that reuses strictly less; where it splits its picks the candidates tie and the
router broke the tie at random, which is reported as a tie with its share, never as a flip (issue 43).
The storage and hybrid findings are measured the same way (:mod:`kvalign.verify.props.storage.impact`,
:mod:`kvalign.verify.props.hybrid.impact`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvalign.model.causes import CACHE_BLIND, CREDIT_SKEW, Cause, cause_class
from kvalign.verify.engine.rows import RowResult
from kvalign.verify.engine.trials import TAIL, Trial, tie_share, trials_said


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

    def state(self) -> str:
        return (f"page size {self.page_size}{' (EAGLE)' if self.eagle else ''}, {self.prompt_tokens}-token prompt, "
                f"one candidate holding {self.device_pages} page(s) on device + {self.host_pages} on host only")

    def as_dict(self) -> dict[str, Any]:
        return {"state": self.state(), "trials": [t.as_dict() for t in self.trials]}

    def says(self) -> str:
        state = self.state()
        flips = [t for t in self.trials if t.changed]
        if flips:
            t = flips[0]
            picked = "the first" if t.chosen == 0 else "the other"
            return (f"changes the worker for {len(flips)} of {len(self.trials)} k: {state}; with the other holding "
                    f"{t.k} page(s) on device the router picks {picked} every time, which reuses "
                    f"{t.reused[t.chosen]} tokens where the {'other' if t.chosen == 0 else 'first'} would reuse "
                    f"{t.reused[1 - t.chosen]}; {tie_share(self.trials)}")
        return (f"does not change the worker: {state}; other candidate holding k pages on device: "
                f"{trials_said(self.trials)}; {tie_share(self.trials)}")


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
            picks = pair.picks(prompt)
            reused = (a.serve(prompt).cached_tokens, b.serve(prompt).cached_tokens)
            impact.trials.append(Trial(k, picks, reused))
    finally:
        pair.close()
    return impact


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
    r.routing = {"counterexample": impact.as_dict()}
    worst = (p, eagle, 1, bound.host_pages)
    if worst != key and bound.host_pages:
        if worst not in measured:
            measured[worst] = measure_routing(p, eagle, 1, bound.host_pages, path=path)
        r.routing["at_the_bound"] = measured[worst].as_dict()
        r.impact = (f"bound: {bound.says()}; on the counterexample the router {measured[key].says()}; at the bound "
                    f"the router {measured[worst].says()}")
    else:
        r.impact = f"bound: {bound.says()}; on the counterexample the router {impact.says()}"
