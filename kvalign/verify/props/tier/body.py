"""The ``tier`` and ``servable`` properties: the router's device / host tiers against SGLang's HiCache.

A Hypothesis state machine drives SGLang's real ``UnifiedRadixCache`` with its host tier on
(:class:`~kvalign.oracles.hicache.HiCacheEngine`: a write policy, a tree core and the sizes of the
device and host pools drawn per example; the transfer path is :mod:`kvalign.standins.hicache`). Its
steps are what one worker sees: a request served by SGLang's own scheduler code (capped match,
prefill admission with its load-back decision, prefill allocation, with SGLang's eviction on
allocation when the device pool runs out, and the finished prompt cached), finished transfers
committed (write-through backups), device pages evicted by outside pressure, host pages evicted, and
a cache flush. After
every step, SGLang's events go through the same path as ``ingest`` (SGLang's real
``ZmqEventPublisher`` -> Dynamo's real worker relay -> event plane -> a real ``KvRouter``,
:class:`~kvalign.oracles.router_path.RouterPath`), and for every prompt in the tree, under every
tenant seen:

* router ``device_blocks`` == SGLang's device prefix (``match_prefix().device_prefix_len``, pages);
* router ``host_pinned_extension_blocks`` == SGLang's host hit past it (``host_hit_length``, pages);
* router ``disk_extension_blocks`` == 0 (SGLang's host tier is the only one beyond device): with
  the two above, nothing is credited that the engine holds nowhere.

``servable`` adds, on every admitted request (:func:`kvalign.verify.props.tier.servable.judge`): where the
router credits host blocks inside the prefix SGLang's scheduler matches (at most ``input_len - 1``
tokens), SGLang loads them back. When SGLang declines (a host-only stretch shorter than its
``load_back_threshold``, read from the cache that SGLang's own ``init_hicache`` configured), the
finding is ``HOST_CREDIT_NOT_SERVABLE``, a mismatch confined to HiCache and page sizes below that
threshold (the row and ``check``'s verdict line say so; docs/check.md#servable). A credited block
past the cap is ``LAST_PAGE_CAPPED``, counted apart on every tier and servable row, never a mismatch.

The verdict compares only the two real systems' answers. kvalign's bookkeeping of which tier each
engine block should be in (from SGLang's own event objects) and a tap on the relay's ZMQ input are
used only to *name* a divergence from the router's index dump.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, get_state_machine_test, initialize, precondition, rule

from kvalign.model.causes import Cause
from kvalign.model.hashing import U64_MASK
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.properties import Mismatch
from kvalign.model.relay import RELAY_TIERS
from kvalign.verify.engine.search import REPLAYS, Tally, generated_cause
from kvalign.verify.props.tier.servable import judge, last_page_condition
from kvalign.verify.engine.strategies import tenants

#: Page sizes the tier machine draws: two below SGLang 0.5.23's load_back_threshold (10 tokens) and
#: one above it. Each (page size, mode) is one registered worker in the router path (shared with ingest).
TIER_PAGE_SIZES = (2, 4, 16)
#: "Evict every unlocked device page" (more than any example caches).
EVICT_ALL_PAGES = 64
#: Device pool sizes drawn per example, in pages (0: larger than any example fills). The smallest
#: still admits the longest first request; below a request's need, SGLang defers it (NO_TOKEN).
DEVICE_PAGES = (4, 8)
#: First tokens of the pressure requests (the prompts draw 0..3; an example's token range is 16 wide).
PRESSURE_TOKENS = range(4, 16)
#: Steps per example (each one publishes, waits for the router, and checks every prompt).
STEPS = 8
#: How long to wait for one published step to be indexed.
SETTLE_TIMEOUT_S = 4.0
#: How long the host sentinel may trail the device one of the same batch.
HOST_SENTINEL_GRACE_S = 0.5


def _medium(ev: Any) -> str | None:
    m = getattr(ev, "medium", None)
    return getattr(m, "value", m)


class WireTap:
    """A ZMQ subscriber beside the relay on SGLang's publisher hop: the media the relay received."""

    def __init__(self, endpoint: str) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        #: engine block hash -> medium of the last BlockStored the relay received for it
        self.stored_medium: dict[int, Any] = {}
        self.received = 0

    def drain(self) -> None:
        while self._sub.poll(0):
            frames = self._sub.recv_multipart()
            self.received += 1
            try:
                batch = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
            except Exception:  # not a batch this tap understands: nothing to attribute
                continue
            for ev in batch[1] if isinstance(batch, list) and len(batch) > 1 else []:
                if isinstance(ev, dict) and ev.get("type") == "BlockStored":
                    for h in ev.get("block_hashes") or []:
                        self.stored_medium[int(h) & U64_MASK] = ev.get("medium")

    def close(self) -> None:
        self._sub.close(linger=0)
        self._ctx.term()


class TierPath:
    """The ``ingest`` router path, with a wire tap per worker and a cheap per-step barrier."""

    def __init__(self, path: Any, host_grace_s: float = HOST_SENTINEL_GRACE_S) -> None:
        self.path = path
        #: how long a step waits for the host sentinel once the device one is indexed (a test of a hop
        #: that never lets it reach the host tier need not sit out the default)
        self.host_grace_s = host_grace_s
        self._taps: dict[int, WireTap] = {}

    def worker(self, page_size: int, eagle: bool) -> tuple[Any, WireTap]:
        try:
            worker = self.path.worker(page_size, eagle)
        except OracleUnavailable as exc:
            raise Mismatch("tier", str(exc), Cause.PATH_UNAVAILABLE, None) from None
        tap = self._taps.get(id(worker))
        if tap is None:
            tap = self._taps[id(worker)] = WireTap(worker.publisher.endpoint)
            for _ in range(40):  # until the tap's subscription is live (ZMQ's slow joiner)
                if not worker.barrier():
                    raise Mismatch("tier", f"the relay never indexed a plain one-page SGLang event "
                                   f"(Dynamo {self.path.version})", Cause.PATH_UNAVAILABLE, None)
                tap.drain()
                if tap.received:
                    break
        return worker, tap

    def settle(self, worker: Any, tap: WireTap) -> tuple[Cause, str] | None:
        """Publish a sentinel page per tier (device and host) and wait until the router credits both,
        so that everything before them on the one stream was processed in each tier's index. With a
        device sentinel alone, Dynamo 1.6.1 sometimes answered before applying the host events
        published ahead of it (the index dump read just after held them): its tiers are not applied
        in one order.
        Polls the router's own overlap answer, not its index dump. A host sentinel the router credits
        in its device tier is misfiled at once (no grace to sit out). None when settled, else the
        named reason (from the index dump and the wire tap) why not."""
        from kvalign.oracles.router_path import SENTINEL_BASE, sentinel_hash

        p, kv = worker.block_size, worker.publisher.kv
        sentinels, queries = [], []
        for medium, key in (("GPU", "device_blocks"), ("CPU_PINNED", "host_pinned_extension_blocks")):
            k = next(worker._sentinels)
            s = SENTINEL_BASE + k
            # a bigram page for an EAGLE worker, so that the router's own (EAGLE) query side can find it
            sentinels.append(kv.BlockStored(block_hashes=[sentinel_hash(k)], parent_block_hash=None,
                                            token_ids=[(s, s)] * p if worker.eagle else [s] * p, block_size=p,
                                            lora_id=None, medium=medium))
            queries.append(([s] * (p + worker.eagle), key))
        deadline, sent_at, device_at = time.monotonic() + SETTLE_TIMEOUT_S, 0.0, None
        while time.monotonic() < deadline:
            if time.monotonic() - sent_at > 0.5:
                worker.publisher.publish(sentinels)
                sent_at = time.monotonic()
            time.sleep(0.001)
            answers = [self.path.query_tiers(worker.router, tokens, None, None) for tokens, _ in queries]
            got = [answer[key] >= 1 for answer, (_, key) in zip(answers, queries)]
            if all(got):
                tap.drain()
                return None
            if got[0] and device_at is None:  # the batch arrived; its host page must be in the host tier by now
                device_at = time.monotonic()
                deadline = min(deadline, device_at + self.host_grace_s)
            if got[0] and answers[1]["device_blocks"] >= 1:  # the host sentinel is in the device tier
                break
        if device_at is None:
            return Cause.EVENTS_DROPPED, (f"the relay stopped indexing (Dynamo {self.path.version}): a sentinel page "
                                          "published after this step never reached the router")
        h = int(sentinels[1].block_hashes[0])
        tap.drain()
        seen_by = time.monotonic() + HOST_SENTINEL_GRACE_S
        while h not in tap.stored_medium and time.monotonic() < seen_by:  # the tap reads the hop beside the relay
            time.sleep(0.001)
            tap.drain()
        held = sorted(str(t) for t, hh in worker.dump_tiers() if hh == h)
        what = ("a host-tier sentinel page (BlockStored[CPU_PINNED], published with a device one after this "
                "step) is not credited in the router's host tier")
        if held:
            return Cause.TIER_MISFILED, f"{what}: the router filed it under {', '.join(held)}"
        wire = tap.stored_medium.get(h, "(not seen)")
        if wire != "(not seen)" and wire not in RELAY_TIERS:
            return Cause.MEDIUM_NOT_INDEXED, (f"{what}: the relay received it with medium {wire!r}, which it maps to "
                                              "no tier, and the router indexed it nowhere")
        return Cause.EVENTS_DROPPED, f"{what}: the router indexed it in no tier (the relay received medium {wire!r})"

    def close(self) -> None:
        for tap in self._taps.values():
            tap.close()
        self._taps.clear()


class _ExpectedTiers:
    """Which engine blocks the router should hold in which tier, from SGLang's own events (naming only)."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[int]] = {"device": set(), "host_pinned": set()}
        self.seen: set[int] = set()
        self.shape: dict[int, str] = {}

    def apply(self, ev: Any) -> None:
        name = type(ev).__name__
        if name == "AllBlocksCleared":
            for s in self.tiers.values():
                s.clear()
            return
        tier = "host_pinned" if _medium(ev) in ("CPU_PINNED", "CPU") else "device"
        hashes = [int(h) & U64_MASK for h in ev.block_hashes]
        if name.startswith("BlockStored"):
            self.tiers[tier].update(hashes)
            self.seen.update(hashes)
            for h in hashes:
                self.shape[h] = f"BlockStored[{_medium(ev)}, {len(hashes)} page(s)]"
        elif name == "BlockRemoved":
            self.tiers[tier].difference_update(hashes)


def name_tier_divergence(expected: _ExpectedTiers, dumped: list[tuple[str | None, int]], tap: WireTap) -> tuple[Cause, str] | None:
    """Name what the router's index holds wrongly, from its own dump; None when it holds what it should."""
    held: dict[int, set[str | None]] = {}
    for tier, h in dumped:
        if h in expected.seen:
            held.setdefault(h, set()).add(tier)
    for tier, hashes in expected.tiers.items():
        for h in sorted(hashes):
            if tier in held.get(h, set()):
                continue
            shape = expected.shape.get(h, "an event")
            if held.get(h):
                return Cause.TIER_MISFILED, (f"SGLang holds engine block {h} in its {tier} tier ({shape}); the router "
                                             f"filed it under {', '.join(sorted(map(str, held[h])))}")
            wire = tap.stored_medium.get(h, "(not seen)")
            if wire != "(not seen)" and wire not in RELAY_TIERS:
                return Cause.MEDIUM_NOT_INDEXED, (f"SGLang holds engine block {h} in its {tier} tier ({shape}); the relay "
                                                  f"received it with medium {wire!r}, which it maps to no tier, and the "
                                                  "router indexed it nowhere")
            return Cause.EVENTS_DROPPED, (f"SGLang holds engine block {h} in its {tier} tier ({shape}); the router "
                                          f"indexed it in no tier (the relay received medium {wire!r})")
    for h, tiers in sorted(held.items()):
        extra = sorted(str(t) for t in tiers if h not in expected.tiers.get(str(t), set()))
        if extra:
            return Cause.INGEST_STALE, f"the router still holds engine block {h} in {', '.join(extra)}, which SGLang removed"
    return None


def _counted(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Count the examples a step fails in (Hypothesis itself only hands back the shrunk one), and keep the
    generated example's mismatch (where Hypothesis cannot replay it, it is reported unshrunk: the one a
    derandomized search generates, where the last shrink step's varied from run to run, issue 46)."""

    @functools.wraps(fn)
    def step(self: TierMachine, *args: Any, **kwargs: Any) -> Any:
        try:
            try:
                return fn(self, *args, **kwargs)
            except OracleUnavailable as exc:  # a piece of this release's path cannot answer
                raise Mismatch("tier", str(exc), Cause.PATH_UNAVAILABLE, self._example()) from None
        except Mismatch as exc:
            self.tally.fail()
            if self.tally.generating or self.last[0] is None:
                self.last[0] = exc  # the generated example's, not a shrink step's (those vary from run to run)
            raise

    return step


class TierMachine(RuleBasedStateMachine):
    """One worker's HiCache life, step by step, checked against the router after every step."""

    def __init__(self, path: TierPath, eagle: bool, lora: bool, namespace: bool, servable: bool,
                 make_engine: Callable[..., Any], cores: tuple[str, ...], tally: Tally, last: list[Mismatch | None],
                 page_sizes: tuple[int, ...] = TIER_PAGE_SIZES, capped: list[Any] | None = None) -> None:
        super().__init__()
        self.page_sizes = page_sizes
        #: the search's runs, generated apart from shrink steps; [the generated example's Mismatch]
        self.tally, self.last = tally, last
        #: [examples with a LAST_PAGE_CAPPED request, the first such example, its judgement] (counted apart)
        self.capped = capped if capped is not None else [0, None, None]
        self._capped_seen = False
        self.pressure = 0
        self.path, self.eagle, self.servable, self.make_engine = path, eagle, servable, make_engine
        self.tenant = tenants(lora=lora, namespace=namespace)
        self.cores = cores
        self.engine: Any = None
        self.prompts: list[tuple[list[int], tuple[str | None, str | None]]] = []
        self.steps: list[Any] = []
        self.expected = _ExpectedTiers()

    # -- set-up -----------------------------------------------------------------------------
    @initialize(p=st.integers(0, len(TIER_PAGE_SIZES) - 1), core=st.integers(0, 1),
                policy=st.sampled_from(("write_through", "write_through_selective", "write_back")),
                host_pages=st.one_of(st.just(0), st.integers(1, 6)),
                device_pages=st.one_of(st.just(0), st.integers(*DEVICE_PAGES)), data=st.data())
    @_counted
    def start(self, p: int, core: int, policy: str, host_pages: int, device_pages: int, data: st.DataObject) -> None:
        """A fresh worker with HiCache on, and its first finished request."""
        core_name = self.cores[core % len(self.cores)]
        p = self.page_sizes[p % len(self.page_sizes)]
        host_tokens = host_pages * p if host_pages else 1 << 20
        device_tokens = device_pages * p if device_pages else None
        self.config = {"page_size": p, "eagle": self.eagle, "core": core_name, "policy": policy,
                       "host_tokens": host_tokens if host_pages else "unbounded",
                       "device_tokens": device_tokens or "unbounded"}
        try:
            self.engine = self.make_engine(p, eagle=self.eagle, core=core_name, policy=policy, host_tokens=host_tokens,
                                           device_tokens=device_tokens)
        except OracleUnavailable as exc:
            raise Mismatch("tier", str(exc), Cause.PATH_UNAVAILABLE, self.config) from None
        self.worker, self.tap = self.path.worker(p, self.eagle)
        self.base = self.worker.token_space()
        self.engine.take_raw_events()
        self._cache(data, first=True)

    def replay(self, example: dict[str, Any]) -> None:
        """Run a recorded example (:meth:`_example`: its configuration and steps) again on a fresh engine,
        step by step as the rules ran it, raising its :class:`Mismatch` where one recurs. Hypothesis cannot
        replay an example whose replay while shrinking took another path (``Flaky``); this does, from the
        steps that example recorded, so that such a mismatch is confirmed or not as every search's is."""
        try:
            self._replay(example)
        except OracleUnavailable as exc:  # as a rule's step reports it (_counted)
            raise Mismatch("tier", str(exc), Cause.PATH_UNAVAILABLE, self._example()) from None

    def _replay(self, example: dict[str, Any]) -> None:
        p = example["page_size"]
        host, device = example["host_tokens"], example["device_tokens"]
        self.config = {k: example[k] for k in ("page_size", "eagle", "policy", "host_tokens", "device_tokens")}
        self.config["core"] = example["core_kind"]
        self.engine = self.make_engine(p, eagle=self.eagle, core=example["core_kind"], policy=example["policy"],
                                       host_tokens=1 << 20 if host == "unbounded" else host,
                                       device_tokens=None if device == "unbounded" else device)
        self.worker, self.tap = self.path.worker(p, self.eagle)
        self.base = self.worker.token_space()
        self.engine.take_raw_events()
        for step in example["steps"]:
            kind = step[0]
            if kind in ("cache", "admit"):
                tokens, tenant = list(step[1]), tuple(step[2])
                admitted = self._serve(tokens, tenant, step)
                if "+transfers_done" in step:
                    self.engine.transfers_done()
                if admitted and kind == "cache":
                    self.prompts.append((tokens, tenant))
                self._after(None)
                continue
            if kind == "transfers_done":
                self.engine.transfers_done()
            elif kind == "evict_device":
                self.engine.evict(step[1] * p)
            elif kind == "evict_host":
                self.engine.evict_host(step[1] * p)
            elif kind == "flush":
                self.engine.reset()
            else:
                raise ValueError(f"a tier example step kvalign does not know: {step!r}")
            self._after(step)

    def _example(self) -> dict[str, Any]:
        config = getattr(self, "config", {})
        # "core": the tree core in use (a class name, for reports); "core_kind": the option that built it (a replay's)
        return {**config, "core": getattr(self.engine, "core", config.get("core")), "core_kind": config.get("core"),
                "steps": list(self.steps)}

    def _shift(self, tokens: list[int]) -> list[int]:
        return [self.base + t for t in tokens]

    # -- steps ------------------------------------------------------------------------------
    @rule(data=st.data())
    @_counted
    def cache_request(self, data: st.DataObject) -> None:
        """A request finishes and its prompt is cached (then the scheduler's transfer poll, or not yet)."""
        self._cache(data)

    def _cache(self, data: st.DataObject, first: bool = False) -> None:
        p = self.engine.page_size
        prefix: list[int] = []
        if self.prompts and data.draw(st.booleans(), label="extends"):
            doc = data.draw(st.sampled_from([t for t, _ in self.prompts]), label="of")
            prefix = doc[: data.draw(st.integers(0, len(doc)), label="cut")]
        least = p + self.eagle if first else 1  # the first request fills at least one page
        tokens = prefix + data.draw(st.lists(st.integers(0, 3), min_size=least, max_size=3 * p + self.eagle), label="new")
        tenant = data.draw(st.one_of(st.just(self.prompts[0][1]), self.tenant) if self.prompts else self.tenant, label="tenant")
        poll = data.draw(st.booleans(), label="poll")
        step = ("cache", tokens, tenant) + (("+transfers_done",) if poll else ())
        admitted = self._serve(tokens, tenant, step)
        if poll:
            self.engine.transfers_done()
        if admitted:
            self.prompts.append((tokens, tenant))
        self._after(None)

    @rule()
    @_counted
    def transfers_done(self) -> None:
        self.engine.transfers_done()
        self._after(("transfers_done",))

    @rule(pages=st.integers(1, 6))
    @_counted
    def evict_device(self, pages: int) -> None:
        self.engine.evict(pages * self.engine.page_size)
        self._after(("evict_device", pages))

    @rule(pages=st.integers(1, 6))
    @_counted
    def evict_host(self, pages: int) -> None:
        self.engine.evict_host(pages * self.engine.page_size)
        self._after(("evict_host", pages))

    def _pressure_room(self) -> int:
        """Tokens a request can take beyond the free device room and still be admitted (SGLang's prefill
        budget counts evictable pages as room: extend + 1 output + a page's overhead); 0 when unbounded."""
        if self.engine is None or self.config.get("device_tokens") == "unbounded":
            return 0
        return max(0, self.engine.evictable_tokens() - 1)

    @precondition(lambda self: self._pressure_room() > 0)
    @rule(data=st.data())
    @_counted
    def pressure_request(self, data: st.DataObject) -> None:
        """Another user's request, longer than the free device room: SGLang's allocator runs out and SGLang
        evicts on allocation (``evict_from_tree_cache`` / ``evict_for_alloc``) to admit it."""
        self.pressure += 1
        p = self.engine.page_size
        over = data.draw(st.integers(1, self._pressure_room()), label="over")
        n = max(1, self.engine.available_tokens() - p + over)
        tokens = [PRESSURE_TOKENS[(self.pressure - 1) % len(PRESSURE_TOKENS)]] * n  # shares no prompt's first token
        tenant = (None, None)
        if self._serve(tokens, tenant, ("cache", tokens, tenant)):
            self.prompts.append((tokens, tenant))
        self._after(None)

    @precondition(lambda self: bool(self.prompts))
    @rule(data=st.data())
    @_counted
    def admit_request(self, data: st.DataObject) -> None:
        """A request for a cached prompt (and maybe a few tokens more) arrives: SGLang's scheduler admits
        it, loading its host-only stretch back or declining to."""
        self._admit(data)

    @precondition(lambda self: bool(self.prompts))
    @rule(pages=st.one_of(st.just(EVICT_ALL_PAGES), st.integers(1, 6)), data=st.data())
    @_counted
    def evict_then_admit(self, pages: int, data: st.DataObject) -> None:
        """Device pressure evicts pages (often all that are unlocked), then a request for a cached
        prompt arrives: the host tier's use."""
        self.engine.evict(pages * self.engine.page_size)
        self._after(("evict_device", pages))
        self._admit(data)

    def _admit(self, data: st.DataObject) -> None:
        prompt, tenant = data.draw(st.sampled_from(self.prompts), label="prompt")
        tokens = prompt + data.draw(st.lists(st.integers(0, 3), max_size=self.engine.page_size + 1), label="more")
        self._serve(tokens, tenant, ("admit", tokens, tenant))
        self._after(None)

    def _serve(self, tokens: list[int], tenant: tuple[str | None, str | None], step: tuple[Any, ...]) -> bool:
        """One request through SGLang's scheduler code, judged against the router's credit for it, which
        equals SGLang's residency of the prompt (a tier row checked every prompt after the previous step;
        a servable row checks this one now). False when SGLang deferred it."""
        query = self._shift(tokens)
        self.steps.append(step)  # before the check below: a mismatch it raises names this step, so it replays
        if self.servable:  # the router's credit is SGLang's residency, or the tier divergence is named here
            self._check(tokens, tenant)
        tiers = self.path.path.query_tiers(self.worker.router, query, *tenant)
        admission = self.engine.serve(query, *tenant)
        if not admission.admitted:
            return False
        threshold = self.engine.load_back_threshold
        j = judge(admission, tiers, self.engine.page_size, eagle=self.eagle, threshold=threshold)
        if j.capped_blocks and not self._capped_seen and self.tally.generating:  # a shrink step's is no case
            self._capped_seen = True
            self.capped[0] += 1
            if self.capped[1] is None:
                self.capped[1], self.capped[2] = self._example(), j
        if self.servable and j.cause is Cause.HOST_CREDIT_NOT_SERVABLE:
            best = self.path.path.call(self.worker.router.best_worker, query, **tenant_kwargs(tenant))
            j = judge(admission, tiers, self.engine.page_size, eagle=self.eagle, threshold=threshold,
                      best_worker_overlap=best[2], host_weight=self.path.path.host_weight)
            exc = Mismatch("servable", j.detail, Cause.HOST_CREDIT_NOT_SERVABLE, self._example(),
                           condition=servable_condition(threshold))
            exc.admission = {**admission.as_dict(), "page_size": self.engine.page_size, "load_back_threshold": threshold}
            raise exc
        return True

    @precondition(lambda self: len(self.steps) >= 6)
    @rule()
    @_counted
    def flush_cache(self) -> None:
        self.engine.reset()
        self._after(("flush",))

    # -- the check after every step ---------------------------------------------------------
    def _after(self, step: Any) -> None:
        if step is not None:
            self.steps.append(step)
        events = self.engine.take_raw_events()
        if events:  # nothing published: nothing for the router to apply, and the check below still runs
            for ev in events:
                self.expected.apply(ev)
            self.worker.publisher.publish(events)
            unsettled = self.path.settle(self.worker, self.tap)
            if unsettled is not None:
                raise Mismatch("tier", unsettled[1], unsettled[0], self._example())
        if self.servable:  # a servable row checks each admitted prompt's residency instead (_serve)
            return
        tenants_seen = list(dict.fromkeys(t for _, t in self.prompts))
        queries = list(dict.fromkeys((tuple(t), ten) for t, ten in self.prompts))
        if self.prompts:
            queries += [(tuple(self.prompts[0][0]), ten) for ten in tenants_seen]
        for tokens, tenant in dict.fromkeys(queries):
            self._check(list(tokens), tenant)

    def _check(self, tokens: list[int], tenant: tuple[str | None, str | None]) -> None:
        query = self._shift(tokens)
        engine = self.engine.residency(query, *tenant)
        router = self.path.path.query_tiers(self.worker.router, query, *tenant)
        got = (router["device_blocks"], router["host_pinned_extension_blocks"], router["disk_extension_blocks"])
        if got == (engine.device, engine.host, 0):
            return
        detail = (f"prompt {tokens} (lora={tenant[0]!r}, cache_salt={tenant[1]!r}): SGLang holds {engine.device} "
                  f"page(s) on device + {engine.host} on host only; the router credits {got[0]} device + {got[1]} "
                  f"host + {got[2]} disk block(s)")
        dumped = self.worker.dump_tiers()
        self.tap.drain()
        named = name_tier_divergence(self.expected, dumped, self.tap)
        cause, why = named if named else (Cause.TIER_RESIDENCY, "the router's index holds every block in the tier "
                                          "SGLang's events name; its per-tier answer still differs")
        raise Mismatch("tier", f"{detail}; {why}", cause, self._example())


def servable_condition(threshold: int) -> str:
    """Where HOST_CREDIT_NOT_SERVABLE can hold: a host-only stretch is at least one page, so from a page
    of ``threshold`` tokens up SGLang loads every one back."""
    return (f"only with HiCache on and page sizes below SGLang's load_back_threshold ({threshold} tokens); "
            f"--page-size {threshold} or more does not show it")


def scoped_entry(capped: list[Any]) -> dict[str, Any]:
    """A row's LAST_PAGE_CAPPED entry, counted apart from its mismatches: how many examples had such a
    request, where it occurs, and the first one seen (unshrunk) with its admission."""
    _n, example, j = capped
    return {"cases": capped[0], "cause": Cause.LAST_PAGE_CAPPED.value, "condition": last_page_condition(),
            "detail": j.detail, "example": example, "admission": j.admission.as_dict(),
            "router_blocks": {"device": j.router_device, "host": j.router_host, "past_cap": j.capped_blocks}}


def tenant_kwargs(tenant: tuple[str | None, str | None]) -> dict[str, str]:
    """The router's keyword arguments for a tenant (an older binding lacks them, so absent ones are left out)."""
    kw = {}
    if tenant[0]:
        kw["lora_name"] = tenant[0]
    if tenant[1]:
        kw["cache_namespace"] = tenant[1]
    return kw


def run_tier_search(path: TierPath, *, eagle: bool, lora: bool, namespace: bool, servable: bool, examples: int,
                    seed: int | None = None, make_engine: Callable[..., Any] | None = None,
                    page_sizes: tuple[int, ...] = TIER_PAGE_SIZES, shrink: bool = True,
                    capped: list[Any] | None = None, tally: Tally | None = None) -> tuple[int, int, Mismatch | None]:
    """Run the state machine ``examples`` times: (generated runs, of them the failing ones, shrunk mismatch).

    ``shrink=False`` stops at the first failing example (the negative controls only need its cause).
    ``capped`` (``[0, None, None]``) collects the LAST_PAGE_CAPPED cases, counted apart: generated runs with
    such a request, the first such example and its :class:`~kvalign.verify.props.tier.servable.Judgement`. Shrink
    steps are neither runs nor capped cases (:class:`~kvalign.verify.engine.search.Tally`; pass one to read them)."""
    from kvalign.oracles.hicache import HiCacheEngine, available_cores

    make = make_engine or HiCacheEngine
    cores = available_cores()
    tally = tally if tally is not None else Tally()
    last: list[Mismatch | None] = [None]

    def factory() -> TierMachine:
        tally.start()
        return TierMachine(path, eagle, lora, namespace, servable, make, cores, tally, last, page_sizes, capped)

    cfg = settings(max_examples=examples, stateful_step_count=STEPS, deadline=None, database=None,
                   derandomize=seed is None, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                   print_blob=False, phases=(Phase.explicit, Phase.generate) + ((Phase.shrink,) if shrink else ()))
    test = get_state_machine_test(factory, settings=cfg)
    if seed is not None:
        from hypothesis import seed as hseed

        test = hseed(seed)(test)
    found: Mismatch | None = None
    try:
        test()
    except Mismatch as exc:
        found = exc
    except Flaky:
        # Hypothesis's replay of the failing example did not fail: it took another path (it does even
        # for a deterministic broken hop), or the mismatch did not recur. Reported unshrunk.
        found = last[0]
        if found is None:
            raise
        found.detail += " (not shrunk: Hypothesis's replay of it did not fail)"
    found = _cause_that_recurs(found, last[0], lambda example: _replayed_cause(
        lambda: TierMachine(path, eagle, lora, namespace, servable, make, cores, Tally(), [None], page_sizes).replay(example)))
    if found is not None and isinstance(found.example, dict) and "steps" in found.example:
        # As every search's (kvalign.verify.engine.search): a finding recurs each time its recorded steps are
        # replayed on a fresh engine, else it is unconfirmed with its rate. (An example without steps: the
        # path failed before the first one, nothing to replay.)
        recurred = sum(_recurs(lambda: TierMachine(path, eagle, lora, namespace, servable, make, cores, Tally(),
                                                   [None], page_sizes).replay(found.example))
                       for _ in range(REPLAYS))
        if recurred < REPLAYS:
            found.unconfirmed = f"recurred in {recurred} of {REPLAYS} replays of its example"
    return tally.cases, tally.mismatches, found


#: replays of the generated example that decide its cause where Hypothesis's last run of it (or the example it shrank
#: to) named another
CAUSE_REPLAYS = 3


def _replayed_cause(replay: Callable[[], None]) -> Cause | None:
    """The cause a replay raised, None where it did not fail."""
    try:
        replay()
    except Mismatch as exc:
        return exc.cause
    return None


def _cause_that_recurs(found: Mismatch | None, generated: Mismatch | None,
                       cause_of: Callable[[dict[str, Any]], Cause | None]) -> Mismatch | None:
    """Which of two differing mismatches a tier search reports: the one whose cause the generated example shows
    most often when its recorded steps are replayed (:data:`CAUSE_REPLAYS` times).

    The first run of an example and Hypothesis's last run of it (or of the example it shrank to) can name two
    causes: Dynamo applies its tiers' events in no fixed order, so an example run while the machine is busy can
    meet a device removal not yet applied (TIER_MISFILED) where every quiet replay shows what the hop did
    (MEDIUM_NOT_INDEXED); and which example shrinking ends at varies from run to run (issue 46). Neither run
    alone decides; the replays do. The shrunk one is kept where its cause is (one of) the most frequent, else
    the generated example with its cause (:func:`generated_cause`)."""
    if found is None or generated is None or found is generated or found.cause is generated.cause \
            or not (isinstance(generated.example, dict) and "steps" in generated.example):
        return found
    seen = [cause_of(generated.example) for _ in range(CAUSE_REPLAYS)]
    top = max(seen.count(c) for c in (found.cause, generated.cause))
    if seen.count(found.cause) == top:
        return found
    return generated_cause(found, generated)


def _recurs(replay: Callable[[], None]) -> bool:
    """Whether a replay raised a :class:`Mismatch` (an :class:`OracleUnavailable` of the path propagates)."""
    try:
        replay()
    except Mismatch:
        return True
    return False


#: servable rows run the base tenant only: load-back does not depend on the tenant.
SERVABLE_VARIANTS = ("base",)
#: servable rows run this many times the tier examples: a finding needs a request cached, its pages
#: moved to host, a device eviction and a request reaching past them in one example. Seeded searches
#: at pages 2 and 4 found one within 41 examples; a row without a finding (pages of 10 or more) runs
#: all 60 in a few seconds.
SERVABLE_FACTOR = 5


def hicache_events(version: str) -> str:
    """Whether this SGLang publishes host-tier events at all, for a skipped row's reason: a pair
    without them has nothing to check; one with them is a gap in kvalign's coverage."""
    try:
        from sglang.srt.disaggregation.kv_events import StorageMedium
    except ImportError:
        return f"SGLang {version} publishes no HiCache events: its kv_events has no StorageMedium"
    return f"SGLang {version} does publish HiCache events (medium {StorageMedium.CPU.value!r})"


def run_tier_rows(systems: Any, prop: str, modes: tuple[str, ...], variants: tuple[str, ...], examples: int,
                  seed: int | None = None, page_size: int | None = None, event_format: str = "default") -> list[Any]:
    """``check``'s rows for ``tier`` (every mode x variant) or ``servable`` (every mode, base variant),
    at ``page_size`` or, by default, every size in :data:`TIER_PAGE_SIZES`, with SGLang's events in
    ``event_format``."""
    import functools

    from kvalign.oracles.hicache import HiCacheEngine

    from kvalign.verify.engine.rows import VARIANTS, RowResult
    from kvalign.standins.hicache import version_problem
    from kvalign.oracles.sglang import sglang_version

    if prop == "servable":
        variants = tuple(v for v in variants if v in SERVABLE_VARIANTS)
    rows: list[Any] = []
    skipped = version_problem(sglang_version())
    if skipped:
        skipped = f"{skipped}; {hicache_events(sglang_version())}"
        return [RowResult(prop, mode, variant, skipped=skipped) for mode in modes for variant in variants]
    try:
        path = TierPath(systems.router_path())
        router = path.path.worker(TIER_PAGE_SIZES[0], False).router
    except OracleUnavailable as exc:
        return [RowResult(prop, mode, variant, 0, 1, 0.0, Cause.PATH_UNAVAILABLE.value, Cause.PATH_UNAVAILABLE.name,
                          str(exc)) for mode in modes for variant in variants]
    if not hasattr(router, "get_overlap_scores"):  # a release before per-tier answers: nothing to compare, no claim
        why = (f"Dynamo {path.path.version}'s KvRouter has no get_overlap_scores, so its answer per tier cannot be "
               "read (what it does with host-tier events is unchecked)")
        return [RowResult(prop, mode, variant, skipped=why) for mode in modes for variant in variants]
    try:
        for mode in modes:
            for variant in variants:
                lora, namespace = VARIANTS[variant]
                start = time.perf_counter()
                n = examples * SERVABLE_FACTOR if prop == "servable" else examples
                capped: list[Any] = [0, None, None]
                tally = Tally()
                calls, failures, found = run_tier_search(path, eagle=mode == "eagle", lora=lora, namespace=namespace,
                                                         servable=prop == "servable", examples=n, seed=seed,
                                                         page_sizes=(page_size,) if page_size else TIER_PAGE_SIZES,
                                                         capped=capped, tally=tally,
                                                         make_engine=functools.partial(
                                                             HiCacheEngine, dynamo_format=event_format == "dynamo"))
                row = RowResult(prop, mode, variant, calls, failures, time.perf_counter() - start)
                row.shrink_steps = tally.shrink_steps
                if found is not None:
                    row.cause, row.cause_name, row.detail = found.cause.value, found.cause.name, found.detail
                    row.counterexample, row.condition = found.example, found.condition
                    row.admission = getattr(found, "admission", None)
                    row.unconfirmed = found.unconfirmed
                if capped[0]:
                    row.scoped = {Cause.LAST_PAGE_CAPPED.name: scoped_entry(capped)}
                rows.append(row)
    finally:
        path.close()
    return rows
