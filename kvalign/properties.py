"""The differential alignment properties, shared by ``kvalign check`` and the unit tests.

Each property takes a router hasher under test plus generated input, drives the real systems,
and raises :class:`Mismatch` (with a named cause) when they disagree:

* ``hash``    — the router hasher equals kvalign's exact reference on any input;
* ``pages``   — every page the real SGLang cache stores, rebuilt from its ``BlockStored`` event
  and hashed the way the router's worker relay does, equals both the router's query-side hash and
  kvalign's reference hash of the same block of the prompt; the router's block count equals
  SGLang's page count;
* ``overlap`` — for a query prompt, SGLang's ``match_prefix`` (in pages) == kvalign's predicted
  overlap == the overlap the router's index answers after ingesting SGLang's events.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvalign.causes import Cause, classify_hash_mismatch
from kvalign.events import BlockStored
from kvalign.hashing import block_hashes
from kvalign.index import PrefixIndex
from kvalign.oracles.base import EngineCache, RouterHasher, RouterIndex
from kvalign.oracles.sglang import lora_id_for
from kvalign.relay import Relay, RouterStored
from kvalign.sglang_keys import engine_block_hashes, event_namespace, event_page_windows, page_windows
from kvalign.strategies import HashCase, Scenario, Tenant

WORKER = 1

CacheFactory = Callable[[int, bool], EngineCache]
IndexFactory = Callable[[], RouterIndex]


class Mismatch(AssertionError):
    """A property found the router and the engine (or the reference) disagreeing."""

    def __init__(self, prop: str, detail: str, cause: Cause, example: Any):
        super().__init__(f"[{prop}] {detail} — cause: {cause.value}")
        self.prop, self.detail, self.cause, self.example = prop, detail, cause, example


def _call(hasher: RouterHasher, tokens: list[int], b: int, eagle: bool, lora: str | None, ns: str | None) -> list[int]:
    return [int(h) for h in hasher(tokens, b, None, lora, eagle, ns)]


def name_cause(hasher: RouterHasher, tokens: list[int], b: int, eagle: bool, lora: str | None, ns: str | None) -> Cause:
    """Name why ``hasher`` disagrees: first on the query side (whole prompt), then on the worker
    side (one engine page window, hashed with the per-event eagle flag as the relay does)."""
    got = _call(hasher, tokens, b, eagle, lora, ns)
    if got != block_hashes(tokens, b, eagle=eagle, lora_name=lora, cache_namespace=ns):
        return classify_hash_mismatch(got, tokens, b, eagle=eagle, lora_name=lora, cache_namespace=ns)
    for window in page_windows(tokens, b, eagle=eagle):
        w = list(window)
        got = _call(hasher, w, b, eagle, lora, ns)
        if got != block_hashes(w, b, eagle=eagle, lora_name=lora, cache_namespace=ns):
            return classify_hash_mismatch(got, w, b, eagle=eagle, lora_name=lora, cache_namespace=ns)
    return Cause.UNKNOWN


def hash_property(hasher: RouterHasher, case: HashCase) -> None:
    """The router hasher equals kvalign's reference for one input."""
    got = [int(h) for h in hasher(case.tokens, case.block_size, case.mm_infos, case.lora_name, case.eagle, case.cache_namespace)]
    want = block_hashes(case.tokens, case.block_size, eagle=case.eagle, lora_name=case.lora_name,
                        cache_namespace=case.cache_namespace, mm_infos=case.mm_infos)
    if got != want:
        cause = classify_hash_mismatch(got, case.tokens, case.block_size, eagle=case.eagle, lora_name=case.lora_name,
                                       cache_namespace=case.cache_namespace, mm_infos=case.mm_infos)
        first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
        raise Mismatch("hash", f"router gives {len(got)} blocks, reference {len(want)}; first difference at block {first}", cause, case)


def _expected_engine_hashes(tokens: list[int], p: int, eagle: bool, lora: str | None, ns: str | None) -> list[int]:
    extra_key = lora_id_for(lora) if lora else None
    namespace = event_namespace(extra_key, ns, lora_registered=bool(lora), dynamo_format=False)
    return engine_block_hashes(tokens, p, eagle=eagle, cache_salt=ns or None, namespace=namespace)


def pages_property(hasher: RouterHasher, make_cache: CacheFactory, sc: Scenario) -> None:
    """Engine pages, hashed worker-side, equal the router's query-side blocks of the prompt."""
    p, eagle = sc.page_size, sc.eagle
    cache = make_cache(p, eagle)
    relay = Relay(p, hasher)
    for tokens, (lora, ns) in sc.inserts:
        cache.insert(tokens, lora_name=lora, cache_salt=ns)
        windows = page_windows(tokens, p, eagle=eagle)
        query_side = _call(hasher, tokens, p, eagle, lora, ns)
        if len(query_side) != len(windows):
            raise Mismatch("pages", f"router hashes {len(query_side)} blocks for a {len(tokens)}-token prompt that "
                           f"SGLang keeps as {len(windows)} pages", name_cause(hasher, tokens, p, eagle, lora, ns), sc)
        reference = block_hashes(tokens, p, eagle=eagle, lora_name=lora, cache_namespace=ns)
        position = {h: k for k, h in enumerate(_expected_engine_hashes(tokens, p, eagle, lora, ns))}
        for ev in cache.take_events():
            if not isinstance(ev, BlockStored):
                continue
            routed = relay.convert(ev)
            locals_ = [t for _e, t in routed.blocks] if isinstance(routed, RouterStored) else []
            for i, (h, window) in enumerate(zip(ev.block_hashes, event_page_windows(ev.token_ids, ev.block_size, len(ev.block_hashes)))):
                k = position.get(h)
                if k is None:
                    raise Mismatch("pages", f"SGLang stored page hash {h} that kvalign's page model cannot place in "
                                   "the prompt", Cause.UNKNOWN, sc)
                if tuple(window) != windows[k]:
                    raise Mismatch("pages", f"page {k}: SGLang's event rebuilds to {window}, kvalign's page model says "
                                   f"{list(windows[k])}", Cause.UNKNOWN, sc)
                relayed = locals_[i] if i < len(locals_) else None
                if relayed != query_side[k] or relayed != reference[k]:
                    raise Mismatch("pages", f"page {k}: the router's worker relay hashes SGLang's page to "
                                   f"{'nothing (dropped)' if relayed is None else relayed}, its query side hashes the "
                                   f"prompt's block {k} to {query_side[k]}, the reference to {reference[k]}",
                                   name_cause(hasher, tokens, p, eagle, lora, ns), sc)


class AlignmentHarness:
    """One engine worker with two router views of it, kept in step by the engine's own events.

    The router under test sees the events through a relay using its hasher and answers from its
    index; kvalign's reference does the same with its exact hasher and :class:`PrefixIndex`. The
    engine's ``match_prefix`` is the ground truth both must reproduce.
    """

    def __init__(self, hasher: RouterHasher, make_cache: CacheFactory, make_index: IndexFactory, page_size: int, eagle: bool):
        self.hasher, self.page_size, self.eagle = hasher, page_size, eagle
        self.cache = make_cache(page_size, eagle)
        self._views = ((make_index(), Relay(page_size, hasher)), (PrefixIndex(), Relay(page_size)))
        self.requests: list[tuple[list[int], Tenant]] = []

    def _pump(self) -> None:
        for ev in self.cache.take_events():
            for index, relay in self._views:
                converted = relay.convert(ev)
                if converted is not None:
                    index.apply(WORKER, converted)

    def insert(self, tokens: list[int], tenant: Tenant = (None, None)) -> None:
        self.cache.insert(tokens, lora_name=tenant[0], cache_salt=tenant[1])
        self.requests.append((list(tokens), tenant))
        self._pump()

    def evict(self, num_tokens: int) -> None:
        self.cache.evict(num_tokens)
        self._pump()

    def check_query(self, query: list[int], tenant: Tenant, example: Any) -> None:
        """SGLang's reuse == kvalign's prediction == the router index's answer, for ``query``."""
        p, eagle, (lora, ns) = self.page_size, self.eagle, tenant
        (router, _), (reference, _) = self._views
        engine = self.cache.match(query, lora_name=lora, cache_salt=ns) // p
        predicted = reference.overlap(block_hashes(query, p, eagle=eagle, lora_name=lora, cache_namespace=ns)).get(WORKER, 0)
        answered = router.overlap(_call(self.hasher, query, p, eagle, lora, ns)).get(WORKER, 0)
        if engine == predicted == answered:
            return
        cause = Cause.UNKNOWN
        if answered != predicted:  # the router side is off: name it from the query or a cached request
            for tokens, (t_lora, t_ns) in [(query, tenant), *self.requests]:
                cause = name_cause(self.hasher, list(tokens), p, eagle, t_lora, t_ns)
                if cause is not Cause.UNKNOWN:
                    break
        raise Mismatch("overlap", f"SGLang reuses {engine} pages, kvalign predicts {predicted}, the router answers {answered}", cause, example)


def overlap_property(hasher: RouterHasher, make_cache: CacheFactory, make_index: IndexFactory, sc: Scenario) -> None:
    """SGLang's reuse == kvalign's prediction == the router index's answer, for the query."""
    harness = AlignmentHarness(hasher, make_cache, make_index, sc.page_size, sc.eagle)
    for tokens, tenant in sc.inserts:
        harness.insert(tokens, tenant)
    harness.check_query(list(sc.query[0]), sc.query[1], sc)
