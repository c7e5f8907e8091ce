"""The ``storage`` property: HiCache's storage tier (L3) and tenants, against the router's tiers.

Each example drives SGLang's real cache with HiCache and the ``file`` storage backend
(:class:`~kvalign.oracles.storage.StorageEngine`): prompts cached, written through to host and to
storage, evicted from device and host, then refilled from storage by the scheduler's own prefetch
call. SGLang's events go through the ``tier`` path (SGLang's publisher -> Dynamo's relay -> a real
``KvRouter``, settled per tier) after every step.

**Tier rows** (variant ``base``), for every prompt:

* storage keys: the pages the ``file`` backend wrote are exactly SGLang's own storage keys of the
  cached pages (``get_storage_hash_str``), else ``STORAGE_KEY_MISMATCH``;
* after every step the router's device and host credit equal SGLang's device and host residency
  (``TIER_RESIDENCY``, ``TIER_MISFILED``, ``EVENTS_DROPPED``, ``INGEST_STALE`` as in ``tier``): in
  particular after a refill, whose host-medium stores are the only events the storage tier causes;
* the request is then served by SGLang's scheduler code (``StorageEngine.serve``: its prefix cap and
  the load-back of the refilled host stretch, which it declines below ``load_back_threshold`` and
  re-prefills); the pages it refilled from storage *and loaded back* are held against the router's
  disk credit before the refill: SGLang publishes no event for a page written to or held in storage,
  so the router credits them in no tier: ``STORAGE_TIER_UNCREDITED``, an under-credit bounded by the
  refilled pages, reported when nothing above failed. A declined refill is counted, never a finding
  (the engine reused nothing the router missed); a row in which no example's refill was loaded back
  could not have failed, so it is ``n/a`` saying so, never ``ok``.

**Tenant rows** (``lora``, ``namespace``, ``lora+namespace``): tenant A's prompt written to storage
and evicted from device and host; tenant B (another LoRA / ``cache_salt``) asks for the same tokens.
B's reuse on every tier must be 0: SGLang's device and host match, what SGLang's prefetch refills
for B from storage, and the router's credit for B (``TENANT_STORAGE_REUSE``, a cross-tenant leak);
and A's own refill must work (a row in which it never did proves nothing: it is ``n/a`` saying so).

Negative controls: tier rows drop SGLang's host-medium stores before the relay (the refill's events
lost: the property must fail with a tier divergence); tenant rows give tenant B tenant A's namespace
on purpose (the property must report ``TENANT_STORAGE_REUSE``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from kvalign.model.causes import Cause
from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.storage import PUMP_TIMEOUT_S
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.engine.search import Tally

PAGE_SIZES = (2, 4)
STORAGE_EXAMPLES = 8
CONTROL_EXAMPLES = 4
#: The tier causes a refill's lost events can show as (the tier control expects one of them).
TIER_CAUSES = (Cause.TIER_RESIDENCY, Cause.TIER_MISFILED, Cause.EVENTS_DROPPED, Cause.INGEST_STALE,
               Cause.MEDIUM_NOT_INDEXED)

Tenant = tuple[str | None, str | None]


@dataclass
class StorageScenario:
    page_size: int
    eagle: bool
    prompts: list[list[int]] = field(default_factory=list)
    #: host pages evicted before the refills (None: all)
    host_evict: int | None = None


@st.composite
def storage_scenarios(draw: st.DrawFn, eagle: bool, page_sizes: tuple[int, ...] | None = None) -> StorageScenario:
    p = draw(st.sampled_from(page_sizes or PAGE_SIZES), label="page_size")
    sc = StorageScenario(p, eagle)
    for _ in range(draw(st.integers(1, 3), label="prompts")):
        prefix: list[int] = []
        if sc.prompts and draw(st.booleans(), label="extends"):
            doc = draw(st.sampled_from(sc.prompts))
            prefix = doc[: draw(st.integers(0, len(doc)), label="cut")]
        # 1 to 6 new pages, drawn evenly: at page size 2 a refilled stretch of 5 or more reaches SGLang's
        # load_back_threshold (10 tokens), below which its scheduler re-prefills what was refilled
        n = draw(st.integers(1, 6), label="pages") * p + eagle + 1
        sc.prompts.append(prefix + draw(st.lists(st.integers(0, 3), min_size=n, max_size=n), label="new"))
    sc.host_evict = draw(st.one_of(st.none(), st.integers(1, 4)), label="host_evict")
    if sc.host_evict is not None:
        sc.host_evict *= p
    return sc


def drop_host_stores(raw: list[Any]) -> list[Any]:
    """Tier control: SGLang's host-medium ``BlockStored`` events never reach the relay."""
    return [ev for ev in raw if not (type(ev).__name__.startswith("BlockStored")
                                     and getattr(getattr(ev, "medium", None), "value", getattr(ev, "medium", None)) != "GPU")]


class StorageRun:
    """One row's search: the tier path shared, a fresh storage engine (and directory) per example."""

    def __init__(self, path: Any, eagle: bool, variant: str, *, mutate: Callable[[list[Any]], list[Any]] | None = None,
                 shared_namespace: bool = False, make_engine: Callable[..., Any] | None = None) -> None:
        from kvalign.oracles.storage import StorageEngine

        self.path, self.eagle, self.variant = path, eagle, variant
        self.mutate, self.shared_namespace = mutate, shared_namespace
        self.make_engine = make_engine or StorageEngine
        #: the search's calls; every count below is of generated examples, never of shrink steps (issue 43)
        self.tally = Tally()
        #: examples with a refill (the storage path exercised), examples in which SGLang refilled pages the
        #: router credited in no tier, the most such pages for one request, and that example's finding
        self.refilled_examples, self.uncredited, self.bound = 0, 0, 0
        #: examples in which SGLang's scheduler loaded a refill back: the only ones where a storage page is
        #: reused, so the only ones a tier row's under-credit can show in (none: the row is ``n/a``)
        self.loaded_examples = 0
        #: refills SGLang's scheduler then declined to load back (a stretch below its load_back_threshold)
        self.declined = 0
        self.finding: Mismatch | None = None

    def tenants(self) -> tuple[Tenant, Tenant]:
        from kvalign.verify.engine.rows import VARIANTS

        lora, ns = VARIANTS[self.variant]
        a = ("tenant-a" if lora else None, "salt-a" if ns else None)
        b = ("tenant-b" if lora else None, "salt-b" if ns else None)
        return a, (a if self.shared_namespace else b)

    def __call__(self, sc: StorageScenario) -> None:
        try:
            engine = self.make_engine(sc.page_size, eagle=sc.eagle)
        except OracleUnavailable as exc:
            raise Mismatch("storage", str(exc), Cause.PATH_UNAVAILABLE, sc) from None
        try:
            worker, tap = self.path.worker(sc.page_size, sc.eagle)
            self._run(engine, worker, tap, sc)
        finally:
            engine.close()

    def _publish(self, engine: Any, worker: Any, tap: Any, sc: StorageScenario, expected: Any) -> None:
        raw = engine.take_raw_events()
        for ev in raw:
            expected.apply(ev)
        if self.mutate:
            raw = self.mutate(raw)
        if raw:
            worker.publisher.publish(raw)
        unsettled = self.path.settle(worker, tap)
        if unsettled is not None:
            raise Mismatch("storage", unsettled[1], unsettled[0], sc)

    def _run(self, engine: Any, worker: Any, tap: Any, sc: StorageScenario) -> None:
        from kvalign.verify.props.tier.body import _ExpectedTiers

        base = worker.token_space()
        shift = lambda t: [base + x for x in t]  # noqa: E731 - this example's own token range
        expected = _ExpectedTiers()
        engine.take_raw_events()
        tenant_rows = self.variant != "base"
        a, b = self.tenants() if tenant_rows else ((None, None), (None, None))
        for tokens in sc.prompts:
            engine.insert(shift(tokens), *a)
            self._publish(engine, worker, tap, sc, expected)
        keys = {k for t in sc.prompts for k in engine.storage_keys(shift(t), *a)}
        # every page's file listed, and no storage write in flight (a listed file may still be being written);
        # a write that outlasts the pump says the machine is slow, not that router and SGLang disagree: an
        # environment error (exit 2), as a prefetch or load-back that outlasts it is (StorageEngine), never a row
        if not engine.pump(lambda: keys <= set(engine.stored_files())) or not engine.pump():
            raise OracleUnavailable(f"SGLang's storage writes did not finish within {PUMP_TIMEOUT_S:.0f} s "
                                    f"({len(set(engine.stored_files()) & keys)} of {len(keys)} page(s) written)")
        self._publish(engine, worker, tap, sc, expected)
        extra = sorted(set(engine.stored_files()) - keys)
        if extra:
            raise Mismatch("storage", f"the file backend holds {len(extra)} page(s) under keys SGLang's "
                           f"get_storage_hash_str gives no cached page (first: {extra[0]})", Cause.STORAGE_KEY_MISMATCH, sc)
        self._check_all(engine, worker, tap, sc, shift, expected, a)
        engine.evict(1 << 16)
        self._publish(engine, worker, tap, sc, expected)
        engine.evict_host(sc.host_evict or 1 << 16)
        self._publish(engine, worker, tap, sc, expected)
        self._check_all(engine, worker, tap, sc, shift, expected, a)
        if tenant_rows:
            self._tenant_b(engine, worker, tap, sc, shift, expected, a, b)
            return
        uncredited: tuple[int, list[int], Any] | None = None
        any_refill = any_loaded = False
        declined = 0
        for tokens in sc.prompts:
            q = shift(tokens)
            before = self.path.path.query_tiers(worker.router, q, None, None)  # what the router routes this request on
            refilled = engine.refill(q)
            self._publish(engine, worker, tap, sc, expected)
            self._check_all(engine, worker, tap, sc, shift, expected, a)
            admitted = engine.serve(q)  # the scheduler loads the refilled stretch back, or declines it
            self._publish(engine, worker, tap, sc, expected)
            self._check_all(engine, worker, tap, sc, shift, expected, a)
            any_refill = any_refill or refilled > 0
            any_loaded = any_loaded or bool(refilled and admitted.loaded_tokens)
            if refilled and not admitted.loaded_tokens:
                declined += 1  # below SGLang's load_back_threshold: re-prefilled, no reuse lost
            served = min(refilled, admitted.loaded_tokens) // sc.page_size  # storage pages SGLang reused
            missing = served - before["disk_extension_blocks"]
            if missing > 0 and (uncredited is None or missing > uncredited[0]):
                uncredited = (missing, tokens, admitted)
        if not self.tally.generating:  # a shrink step's refills are no example's (Tally)
            return
        self.refilled_examples += any_refill
        self.loaded_examples += any_loaded
        self.declined += declined
        if uncredited is not None:  # counted, not raised: the search goes on checking the refills' events
            n, tokens, admitted = uncredited
            self.uncredited += 1
            if n > self.bound:
                self.bound = n
                self.finding = Mismatch(
                    "storage", f"prompt {tokens}: SGLang refilled {n} page(s) from its storage tier for the request and "
                    f"its scheduler loaded them back (cached_tokens {admitted.cached_tokens} of "
                    f"{admitted.prompt_tokens}; load_back_threshold {engine.load_back_threshold}), which the router "
                    "credited in no tier (0 disk blocks): SGLang publishes nothing for a page written to or held in "
                    "storage; only the refill's host-tier stores reach the router, after routing. Class: cache-blind "
                    "(the keys agree, but no event says a page is in storage: credit lost, no constant bound)",
                    Cause.STORAGE_TIER_UNCREDITED, {**self._example(sc), "uncredited_pages": n,
                                                    "admission": admitted.as_dict()},
                    condition=storage_condition())

    def _check_all(self, engine: Any, worker: Any, tap: Any, sc: StorageScenario, shift: Callable[[list[int]], list[int]],
                   expected: Any, tenant: Tenant) -> None:
        from kvalign.verify.props.tier.body import name_tier_divergence

        for tokens in sc.prompts:
            q = shift(tokens)
            held = engine.tiers(q, *tenant)
            router = self.path.path.query_tiers(worker.router, q, *tenant)
            got = (router["device_blocks"], router["host_pinned_extension_blocks"])
            if got == (held.device, held.host):
                continue
            named = name_tier_divergence(expected, worker.dump_tiers(), tap)
            cause, why = named if named else (Cause.TIER_RESIDENCY, "the router's index holds every block in the tier "
                                              "SGLang's events name; its per-tier answer still differs")
            raise Mismatch("storage", f"prompt {tokens} (lora={tenant[0]!r}, cache_salt={tenant[1]!r}): SGLang holds "
                           f"{held.device} page(s) on device + {held.host} on host + {held.storage} in storage only; the "
                           f"router credits {got[0]} device + {got[1]} host + {router['disk_extension_blocks']} disk; "
                           f"{why}", cause, self._example(sc))

    def _tenant_b(self, engine: Any, worker: Any, tap: Any, sc: StorageScenario, shift: Callable[[list[int]], list[int]],
                  expected: Any, a: Tenant, b: Tenant) -> None:
        refilled_a = False
        for tokens in sc.prompts:
            q = shift(tokens)
            held = engine.tiers(q, *b)
            router = self.path.path.query_tiers(worker.router, q, *b)
            refilled = engine.refill(q, *b) // sc.page_size
            self._publish(engine, worker, tap, sc, expected)
            credited = router["device_blocks"] + router["host_pinned_extension_blocks"] + router["disk_extension_blocks"]
            if held.device or held.host or held.storage or refilled or credited:
                raise Mismatch("storage", f"prompt {tokens}: tenant B (lora={b[0]!r}, cache_salt={b[1]!r}) after tenant A "
                               f"(lora={a[0]!r}, cache_salt={a[1]!r}) cached it: SGLang holds {held.device} device + "
                               f"{held.host} host + {held.storage} storage page(s) for B, refilled {refilled} page(s) of "
                               f"A's from storage for B, and the router credits B {credited} block(s): a cross-tenant "
                               "leak", Cause.TENANT_STORAGE_REUSE, self._example(sc))
            refilled_a = refilled_a or bool(engine.refill(q, *a))  # A's own pages still refill: the row is not vacuous
        if self.tally.generating:  # a shrink step's refill is no example's (Tally)
            self.refilled_examples += refilled_a

    def _example(self, sc: StorageScenario) -> dict[str, Any]:
        a, b = self.tenants() if self.variant != "base" else ((None, None), (None, None))
        return {"page_size": sc.page_size, "eagle": sc.eagle, "prompts": sc.prompts, "host_evict": sc.host_evict or "all",
                **({"tenant_a": a, "tenant_b": b} if self.variant != "base" else {})}


def unexercised(body: StorageRun, variant: str, calls: int) -> str | None:
    """Why a row whose search found nothing checked nothing of its subject (the row is then ``n/a``, never
    ``ok``), or None. A tier row's subject is a storage page SGLang reuses, which happens only when its
    scheduler loads a refill back; a tenant row's is tenant A's pages coming back from storage, without
    which tenant B's zero reuse says nothing of the storage tier (issue 43: such a row said ok)."""
    if variant == "base" and not body.loaded_examples:
        return (f"ran {calls} example(s), none exercising what this row checks: no refill from storage was loaded back "
                f"by SGLang's scheduler ({body.refilled_examples} example(s) refilled, {body.declined} declined below "
                "its load_back_threshold and re-prefilled), so no storage page was reused for the router's credit to "
                "be held against (more --storage-examples, or a page size whose refills reach the threshold)")
    if variant != "base" and not body.refilled_examples:
        return (f"ran {calls} example(s), none exercising what this row checks: tenant A's own pages never came back "
                "from storage, so tenant B's zero reuse says nothing of the storage tier (more --storage-examples)")
    return None


def exercised(body: StorageRun, variant: str, calls: int) -> str:
    """An ``ok`` (or ``n/a``) row's detail: how many of its examples exercised its subject."""
    if variant == "base":
        return (f"SGLang's scheduler loaded a refill from storage back in {body.loaded_examples} of {calls} example(s) "
                f"({body.refilled_examples} refilled, {body.declined} refill(s) declined below its load_back_threshold)")
    return (f"tenant A's own pages refilled from storage in {body.refilled_examples} of {calls} example(s) while "
            "tenant B reused none of them on any tier")


def storage_condition() -> str:
    return ("only with HiCache's storage tier on (--hicache-storage-backend); Dynamo's shared-cache contract "
            "(shared_cache_type=hicache) queries a Mooncake store instead and is not driven here")


def run_storage_rows(systems: Any, modes: tuple[str, ...], variants: tuple[str, ...], examples: int,
                     seed: int | None = None, page_size: int | None = None) -> list[Any]:
    """``check``'s storage rows: ``base`` (tiers) and the tenant variants, per mode, each with its control."""
    from kvalign.oracles.sglang import sglang_version
    from kvalign.standins.hicache_storage import version_problem
    from kvalign.verify.engine.rows import RowResult
    from kvalign.verify.engine.search import run_search
    from kvalign.verify.props.tier.body import TierPath

    skipped = version_problem(sglang_version())
    if skipped:
        return [RowResult("storage", m, v, skipped=skipped) for m in modes for v in variants]
    try:
        path = TierPath(systems.router_path())
    except OracleUnavailable as exc:
        return [RowResult("storage", m, v, 0, 1, 0.0, Cause.PATH_UNAVAILABLE.value, Cause.PATH_UNAVAILABLE.name, str(exc))
                for m in modes for v in variants]
    sizes = (page_size,) if page_size else PAGE_SIZES
    rows: list[Any] = []
    try:
        for mode in modes:
            eagle = mode == "eagle"
            for variant in variants:
                start = time.perf_counter()
                body = StorageRun(path, eagle, variant)
                calls, failures, found = run_search(body, storage_scenarios(eagle, sizes), examples, seed=seed,
                                                    tally=body.tally)
                row = RowResult("storage", mode, variant, calls, failures, time.perf_counter() - start)
                row.shrink_steps = body.tally.shrink_steps
                if found is None and body.finding is not None:  # the under-credit, once nothing else failed
                    found, row.mismatches = body.finding, body.uncredited
                    found.detail += (f"; bound seen: up to {body.bound} refilled page(s) per request credited in no tier "
                                     f"(at most the prompt's pages in storage, up to its prefix cap); in {body.uncredited} "
                                     f"of {calls} example(s) (the example is the first with the largest, not shrunk); "
                                     f"{body.declined} refill(s) SGLang's scheduler declined to load back (below its "
                                     "load_back_threshold: re-prefilled, so not counted)")
                if found is not None:
                    row.cause, row.cause_name, row.detail = found.cause.value, found.cause.name, found.detail
                    row.counterexample, row.condition = found.example, found.condition
                else:  # a pass, or n/a where no example exercised the row's subject
                    row.skipped, row.detail = unexercised(body, variant, calls), exercised(body, variant, calls)
                if variant == "base":
                    control = StorageRun(path, eagle, variant, mutate=drop_host_stores)
                    what, ok = "drop_host_stores (SGLang's host-tier stores, a refill's included, never reach the relay)", \
                        TIER_CAUSES
                else:
                    control = StorageRun(path, eagle, variant, shared_namespace=True)
                    what, ok = "shared_namespace (tenant B sent with tenant A's LoRA / cache_salt on purpose)", \
                        (Cause.TENANT_STORAGE_REUSE,)
                c_calls, _f, c_found = run_search(control, storage_scenarios(eagle, sizes), CONTROL_EXAMPLES, seed=seed)
                row.control = {"mutation": what, "cases": c_calls, "failed": c_found is not None and c_found.cause in ok,
                               "cause": c_found.cause.name if c_found is not None else None,
                               "expected": " / ".join(c.name for c in ok)}
                rows.append(row)
    finally:
        path.close()
    return rows
