"""The differential alignment properties, shared by ``kvalign check`` and the unit tests.

Each property takes a router hasher under test plus generated input, drives the real systems,
and raises :class:`Mismatch` (with a named cause) when they disagree:

* ``hash``    — the router hasher equals kvalign's exact reference on any input;
* ``pages``   — every page the real SGLang cache stores, rebuilt from its ``BlockStored`` event
  and hashed the way the router's worker relay does, equals both the router's query-side hash and
  kvalign's reference hash of the same block of the prompt; the router's block count equals
  SGLang's page count;
* ``overlap`` — for a query prompt, SGLang's ``match_prefix`` (in pages) == kvalign's predicted
  overlap == the overlap the router's index answers after ingesting SGLang's events;
* ``card``    — the ``enable_eagle`` the installed ``dynamo.sglang`` registration code puts on the
  model card equals whether SGLang keys that speculative algorithm's cache by bigrams;
* ``ingest``  — SGLang's real publisher output, through the installed Dynamo's real worker relay and
  event plane into a real ``KvRouter``, leaves the router's index answering the same overlap as
  SGLang's ``match_prefix`` and kvalign's prediction, per tenant; when not, the router's index
  dump says which events were dropped, mis-hashed, salt-blind or left stale.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvalign.model.causes import Cause, classify_hash_mismatch
from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvalign.model.hashing import U64_MASK, block_hashes
from kvalign.model.index import PrefixIndex
from kvalign.oracles.base import EngineCache, OracleUnavailable, RouterHasher, RouterIndex
from kvalign.oracles.sglang import lora_id_for
from kvalign.model.relay import Relay, RouterStored
from kvalign.model.sglang_keys import (engine_block_hashes, event_namespace, event_page_windows, is_bigram_payload, page_windows,
                                 raw_window)
from kvalign.verify.engine.strategies import HashCase, IngestScenario, Scenario, Tenant

WORKER = 1

CacheFactory = Callable[[int, bool], EngineCache]
IndexFactory = Callable[[], RouterIndex]


class Mismatch(AssertionError):
    """A property found the router and the engine (or the reference) disagreeing."""

    def __init__(self, prop: str, detail: str, cause: Cause, example: Any, condition: str | None = None):
        super().__init__(f"[{prop}] {detail} — cause: {cause.value}")
        self.prop, self.detail, self.cause, self.example = prop, detail, cause, example
        #: the configurations the mismatch is confined to (e.g. HiCache on, small pages), for the row and verdict
        self.condition = condition
        #: how often it recurred when its example was replayed, where it did not recur every time (None: it did)
        self.unconfirmed: str | None = None
        #: the input the body was handed, as the search drew it (replayed to confirm a finding): ``example`` may be a
        #: display form (a dict) the body cannot take; the search sets it where it saw the mismatch raised
        self.drawn: Any = example


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


def _expected_engine_hashes(tokens: list[int], p: int, eagle: bool, lora: str | None, ns: str | None,
                            lora_named: bool = True, salted: bool = True, dynamo_format: bool = False) -> list[int]:
    """SGLang's event hashes for a request's pages; ``salted=False``: a release (0.5.9, 0.5.14) whose
    event hashes chain the tokens alone, whatever the request's ``cache_salt``; ``dynamo_format``:
    SGLang's "dynamo" event format, every hash namespaced by (extra_key, cache_salt)."""
    extra_key = lora_id_for(lora) if lora else None
    namespace = event_namespace(extra_key, ns, lora_registered=bool(lora) and lora_named, dynamo_format=dynamo_format)
    return engine_block_hashes(tokens, p, eagle=eagle, cache_salt=(ns or None) if salted else None, namespace=namespace)


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
        lora_named = getattr(cache, "names_lora_in_events", True)
        salted = getattr(cache, "salts_event_hashes", True)
        fmt = getattr(cache, "dynamo_format", False)
        position = {h: k for k, h in enumerate(_expected_engine_hashes(tokens, p, eagle, lora, ns, lora_named, salted, fmt))}
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
                if lora and not ev.lora_name and relayed != query_side[k]:
                    raise Mismatch("pages", f"page {k}: SGLang's event for a {lora!r} request carries no LoRA name, so "
                                   "the router's relay keys it as a base-model page", Cause.LORA_NOT_IN_EVENTS, sc)
                if ns and not salted and relayed != query_side[k]:
                    raise Mismatch("pages", f"page {k}: SGLang's event for a cache_salt {ns!r} request carries no salt "
                                   "(its hash is the unsalted one), so the router's relay keys it as an unsalted page",
                                   Cause.SALT_NOT_IN_EVENTS, sc)
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
        self.unnamed_lora_events = False  # a LoRA request's pages arrived without the LoRA name
        self.unsalted_events = False  # a cache_salt request's pages arrived without the salt

    def _pump(self, lora: str | None = None) -> None:
        for ev in self.cache.take_events():
            if lora and isinstance(ev, BlockStored) and not ev.lora_name:
                self.unnamed_lora_events = True
            for index, relay in self._views:
                converted = relay.convert(ev)
                if converted is not None:
                    index.apply(WORKER, converted)

    def insert(self, tokens: list[int], tenant: Tenant = (None, None)) -> None:
        self.cache.insert(tokens, lora_name=tenant[0], cache_salt=tenant[1])
        self.requests.append((list(tokens), tenant))
        self.unsalted_events |= bool(tenant[1]) and not getattr(self.cache, "salts_event_hashes", True)
        self._pump(tenant[0])

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
        if lora and self.unnamed_lora_events:
            cause = Cause.LORA_NOT_IN_EVENTS
        elif self.unsalted_events and engine != predicted:  # the tree keeps the tenants apart, the events do not
            cause = Cause.SALT_NOT_IN_EVENTS
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


def card_property(derive: Callable[[str | None], bool | None], sglang_bigrams: Callable[[str | None], bool],
                  algorithm: str | None) -> None:
    """The card ``dynamo.sglang`` registers for ``algorithm`` hashes queries the way SGLang keys pages."""
    want = sglang_bigrams(algorithm)
    got = derive(algorithm)
    if bool(got) == want:
        return
    note = " (this release's ModelRuntimeConfig has no enable_eagle field)" if got is None else ""
    raise Mismatch("card", f"--speculative-algorithm {algorithm}: SGLang keys its radix cache by "
                   f"{'bigrams' if want else 'plain tokens'}, the registered card says enable_eagle={bool(got)}{note}",
                   Cause.CARD_EAGLE_OFF if want else Cause.CARD_EAGLE_ON, algorithm)


def _event_shape(ev: BlockStored, batch: list[Any]) -> str:
    kinds = sorted({type(e).__name__ for e in batch})
    parts = ["bigram" if is_bigram_payload(ev.token_ids) else "plain", f"{len(ev.block_hashes)} page(s)"]
    if ev.lora_name:
        parts.append(f"lora_name={ev.lora_name!r}")
    if ev.cache_salt:
        parts.append(f"cache_salt={ev.cache_salt!r} (metadata)")
    if ev.parent_block_hash is not None:
        parts.append("with parent")
    return f"BlockStored[{', '.join(parts)}] in a batch of {len(batch)} event(s) ({'+'.join(kinds)})"


class _ExpectedIndex:
    """What the router's index must hold after the engine's events: engine hash -> page facts.

    Kept from SGLang's events with kvalign's reference relay rules (windows, per-event EAGLE,
    namespace inheritance), only to *name* a divergence; the verdict is the overlap comparison.
    """

    def __init__(self, page_size: int):
        self.p = page_size
        self.blocks: dict[int, tuple[list[int], bool, str | None, str | None, str]] = {}
        self._ns: dict[int, str | None] = {}
        self.seen: set[int] = set()  # every engine hash this example stored

    def apply(self, ev: Any, batch: list[Any], converted: Any) -> None:
        """``converted``: the reference relay's router event for ``ev`` (None when Dynamo drops it)."""
        if isinstance(ev, AllBlocksCleared):
            self.blocks.clear()
            self._ns.clear()
        elif isinstance(ev, BlockRemoved):
            for h in ev.block_hashes:
                self.blocks.pop(h & U64_MASK, None)
        elif isinstance(ev, BlockStored) and isinstance(converted, RouterStored):
            eagle = is_bigram_payload(ev.token_ids)
            raw = raw_window(ev.token_ids, strict=False) if ev.token_ids else []
            parent = None if ev.parent_block_hash is None else ev.parent_block_hash & U64_MASK
            ns = ev.cache_salt or (self._ns.get(parent) if parent is not None else None)
            for i, (h, _local) in enumerate(converted.blocks):
                window = raw[i * self.p: i * self.p + self.p + eagle]
                self.blocks[h] = (window, eagle, ev.lora_name, ns, _event_shape(ev, batch))
                self._ns[h] = ns


def _name_ingest_divergence(expected: _ExpectedIndex, dumped: dict[int, int], p: int) -> tuple[Cause, str] | None:
    """Name what the router's index got wrong, from its own dump; None when it holds exactly what it should."""
    for h, (window, eagle, lora, ns, shape) in expected.blocks.items():
        local = dumped.get(h)
        if local is None:
            return Cause.EVENTS_DROPPED, f"the router never indexed engine block {h} from {shape}"
        want = block_hashes(window, p, eagle=eagle, lora_name=lora, cache_namespace=ns)
        if [local] == want:
            continue
        if ns and [local] == block_hashes(window, p, eagle=eagle, lora_name=lora):
            return Cause.TENANTS_SHARE_KEYS, f"engine block {h} from {shape} was indexed without its cache_salt {ns!r}"
        cause = classify_hash_mismatch([local], window, p, eagle=eagle, lora_name=lora, cache_namespace=ns)
        return cause, f"engine block {h} from {shape} was indexed with local hash {local}, reference {want[0] if want else None}"
    stale = sorted((set(dumped) & expected.seen) - set(expected.blocks))
    if stale:
        return Cause.INGEST_STALE, f"the router still holds {len(stale)} block(s) SGLang removed or cleared (e.g. {stale[0]})"
    return None


def engine_batches(make_cache: CacheFactory, isc: IngestScenario, shift: Callable[[list[int]], list[int]],
                   clear: Callable[[], Any]) -> tuple[EngineCache, list[list[Any]]]:
    """Run ``isc``'s requests through a real SGLang cache: (the cache as it ends, the ZMQ batches of
    SGLang's own event objects it published). ``clear()`` makes SGLang's ``AllBlocksCleared``.
    Shared by ``ingest`` and ``kvalign report`` so a report replays exactly what the property sent."""
    sc = isc.scenario
    p, eagle = sc.page_size, sc.eagle
    cache = make_cache(p, eagle)
    steps: list[list[Any]] = []
    for i, (tokens, (lora, ns)) in enumerate(sc.inserts):
        cache.insert(shift(tokens), lora_name=lora, cache_salt=ns)
        steps.append(cache.take_raw_events())
        if i == isc.clear_after:  # the engine drops its cache: SGLang's AllBlocksCleared, then an empty cache
            steps.append([clear()])
            cache = make_cache(p, eagle)
    if isc.evict_tokens:
        cache.evict(isc.evict_tokens)
        steps.append(cache.take_raw_events())
    return cache, ([[e for step in steps for e in step]] if isc.one_batch else steps)


def ingest_property(path: Any, hasher: RouterHasher, make_cache: CacheFactory, isc: IngestScenario) -> None:
    """SGLang's published events, ingested by the real relay into a real router, give SGLang's reuse.

    A path that cannot answer at any step (a worker that cannot start, a runtime loop that stopped
    returning) is PATH_UNAVAILABLE for the example, at once: an exception of another kind would be
    shrunk by Hypothesis, every attempt waiting on the same dead path."""
    try:
        _ingest(path, hasher, make_cache, isc)
    except OracleUnavailable as exc:
        raise Mismatch("ingest", str(exc), Cause.PATH_UNAVAILABLE, isc) from None


def _ingest(path: Any, hasher: RouterHasher, make_cache: CacheFactory, isc: IngestScenario) -> None:
    from kvalign.oracles.sglang import to_kvalign_event

    sc = isc.scenario
    p, eagle = sc.page_size, sc.eagle
    worker = path.worker(p, eagle)
    ready = worker.barrier()
    if not ready and worker.indexed_once and (p, eagle) not in path.refreshed:
        # A worker that went quiet between examples (an idle registration some releases expire in
        # this in-process runtime) is replaced once; only a fresh relay that also stops is a finding.
        worker = path.worker(p, eagle, fresh=True)
        ready = worker.barrier()
    if not ready and worker.indexed_once:
        raise Mismatch("ingest", f"Dynamo {path.version}'s relay stopped indexing altogether after an earlier batch "
                       "(every later event is dropped)", Cause.EVENTS_DROPPED, isc)
    if not ready:
        raise Mismatch("ingest", f"the relay never indexed a plain one-page SGLang event (Dynamo {path.version})",
                       Cause.PATH_UNAVAILABLE, isc)
    base = worker.token_space()
    shift = lambda tokens: [base + t for t in tokens]  # noqa: E731 - this example's own token range
    cache, batches = engine_batches(make_cache, isc, shift, worker.publisher.clear)
    reference, ref_relay, expected = PrefixIndex(), Relay(p), _ExpectedIndex(p)
    unnamed_lora = False
    for raw in batches:
        events = [to_kvalign_event(e) for e in raw]
        for ev in events:
            if isinstance(ev, BlockStored):
                expected.seen.update(h & U64_MASK for h in ev.block_hashes)
                unnamed_lora = unnamed_lora or (not ev.lora_name and any(t[0] for _, t in sc.inserts))
            converted = ref_relay.convert(ev)
            if converted is not None:
                reference.apply(WORKER, converted)
            expected.apply(ev, events, converted)
        if raw:
            worker.publisher.publish(raw)
    if not worker.barrier():
        shapes = sorted({_event_shape(ev, []).split(" in a batch")[0] for raw in batches
                         for ev in map(to_kvalign_event, raw) if isinstance(ev, BlockStored)})
        raise Mismatch("ingest", "the relay stopped indexing after this scenario's batches (a plain sentinel page "
                       f"published after them never reached the router); stored events sent: {'; '.join(shapes)}",
                       Cause.EVENTS_DROPPED, isc)
    # The index first: it must hold exactly the blocks SGLang's events describe, keyed as the router keys them.
    named = _name_ingest_divergence(expected, {h: t for _p, h, t in worker.dump() if h in expected.seen}, p)
    if named is not None:
        raise Mismatch("ingest", named[1], named[0], isc)
    queries = [sc.query] + [(sc.inserts[0][0], t) for t in dict.fromkeys([t for _, t in sc.inserts] + [(None, None)])]
    for query, (lora, ns) in queries:
        query = shift(query)
        engine = cache.match(query, lora_name=lora, cache_salt=ns) // p
        predicted = reference.overlap(block_hashes(query, p, eagle=eagle, lora_name=lora, cache_namespace=ns)).get(WORKER, 0)
        if not query:  # no request has an empty prompt (1.0.x's scheduler panics on one); nothing to match
            continue
        try:
            answered = worker.overlap(query, lora, ns)
        except Exception as exc:  # the release's router failed on a request: the path is down for it
            raise Mismatch("ingest", f"the router failed to answer a {len(query)}-token query: {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}", Cause.PATH_UNAVAILABLE, isc) from None
        if engine == predicted == answered:
            continue
        detail = (f"tenant (lora={lora!r}, cache_salt={ns!r}): SGLang reuses {engine} pages, kvalign predicts "
                  f"{predicted}, the router answers {answered}")
        if engine != predicted:
            if lora and unnamed_lora:
                raise Mismatch("ingest", detail + "; SGLang's events for this LoRA carried no LoRA name",
                               Cause.LORA_NOT_IN_EVENTS, isc)
            if any(t[1] for _, t in sc.inserts) and not getattr(cache, "salts_event_hashes", True):
                raise Mismatch("ingest", detail + "; SGLang's events for the salted requests carried no cache_salt",
                               Cause.SALT_NOT_IN_EVENTS, isc)
            raise Mismatch("ingest", detail + " (kvalign's page model disagrees with SGLang)", Cause.UNKNOWN, isc)
        # The index is right, so the router's query side is off: first what this release cannot express.
        missing = sorted(getattr(path, "missing", ()))
        if eagle and "ModelRuntimeConfig.enable_eagle" in missing:
            cause = Cause.ROUTER_EAGLE_OFF
        elif ns and "KvRouter query cache_namespace" in missing:
            cause = Cause.NAMESPACE_DROPPED
        else:
            cause = name_cause(hasher, query, p, eagle, lora, ns)
        raise Mismatch("ingest", detail + "; the router's index holds the right blocks, its query side hashes "
                       "differently" + (f" (this release lacks {', '.join(missing)})" if missing else ""), cause, isc)
