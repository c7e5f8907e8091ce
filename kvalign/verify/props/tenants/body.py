"""The ``tenants`` property: tenants that cache the same tokens stay apart in the router's index.

SGLang keys a LoRA adapter's pages (``extra_key`` ends with the adapter's id) and a ``cache_salt``
tenant's pages apart from the base model's; the router can only do the same if every event says
whose page it is: its hash (the router's index is keyed by it, so two tenants' pages with one hash
are one entry, and removing either removes both), its ``lora_name`` and ``cache_salt`` (the relay
hashes them into the router's key), and its parent (a page is attached below its parent's entry).
SGLang 0.5.23's ``KVEventsConfig.format = "dynamo"`` namespaces every published hash by
``(extra_key, cache_salt)`` and names the LoRA with an adapter-id fallback (``mem_cache/events.py``,
``rust_tree_core/adapter.py``); the default format namespaces only a LoRA whose name it knows.

Each generated scenario has 2-4 tenants cache one prompt (the same tokens), one of them a branch of
it (a child page whose parent is in its own namespace), some LoRA requests reaching the scheduler
without their name (SGLang then knows it only from its adapter table: the id fallback), and the first
tenant's pages evicted (a ``BlockRemoved`` in one namespace). SGLang's real cache publishes, SGLang's
real publisher sends, and Dynamo's real relay and router ingest (the ``ingest`` path). Then, for every
tenant and prompt, the router's overlap must equal SGLang's ``match_prefix``: kept apart on store and
on removal. A divergence is named from SGLang's events: two tenants' pages published under one hash
(``TENANT_HASH_COLLISION``), a page whose parent is another tenant's (``PARENT_OUTSIDE_NAMESPACE``), a
LoRA page published with no name (``LORA_NOT_IN_EVENTS``) or another name than the request's
(``LORA_NAME_MISMATCH``); else from the router's index dump, as ``ingest`` names it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from kvalign.model.causes import Cause
from kvalign.model.events import BlockStored
from kvalign.model.hashing import U64_MASK
from kvalign.model.relay import Relay
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.properties import Mismatch, _ExpectedIndex, _name_ingest_divergence
from kvalign.verify.engine.strategies import INGEST_PAGE_SIZES, Tenant, token_ids

#: Tenants a scenario draws from, per variant flag (the base model is always one of them).
LORAS = ("loraA", "loraB")
SALTS = ("tenant-1", "tenant-2")

#: ``mutate(raw_events, published)``: what a negative control does to SGLang's events before they are sent.
Mutate = Callable[[list[Any], "Published"], list[Any]]


@dataclass(frozen=True)
class TenantScenario:
    """Tenants caching one prompt on one worker, then the first tenant's pages evicted (or not)."""

    page_size: int
    eagle: bool
    doc: list[int]
    tenants: list[Tenant]  # distinct, in caching order: the first is the least recently used
    unnamed: tuple[str, ...] = ()  # LoRA names whose requests carry no name (SGLang's adapter-id fallback)
    branch: tuple[int, int, list[int]] | None = None  # (tenant index, pages kept, new tokens): a child page
    evict: bool = False

    def prompts(self, i: int) -> list[list[int]]:
        """Tenant ``i``'s prompts: the shared one, and its branch when it has one."""
        out = [self.doc]
        if self.branch is not None and self.branch[0] == i:
            _, pages, suffix = self.branch
            out.append(self.doc[: pages * self.page_size + self.eagle] + suffix)
        return out


def tenant_pool(*, lora: bool, namespace: bool) -> list[Tenant]:
    """The tenants of a variant: the base model, each LoRA, each salt, and both combined."""
    loras: tuple[str | None, ...] = (None, *LORAS) if lora else (None,)
    salts: tuple[str | None, ...] = (None, *SALTS) if namespace else (None,)
    return [(lo, s) for lo in loras for s in salts]


@st.composite
def tenant_scenarios(draw: st.DrawFn, *, eagle: bool, lora: bool, namespace: bool,
                     page_sizes: tuple[int, ...] = INGEST_PAGE_SIZES) -> TenantScenario:
    p = draw(st.sampled_from(page_sizes))
    doc = draw(token_ids(min_size=2 * p + int(eagle), max_size=4 * p + int(eagle), vocab=4))
    tenants = draw(st.lists(st.sampled_from(tenant_pool(lora=lora, namespace=namespace)), min_size=2, max_size=4,
                            unique=True))
    names = sorted({t[0] for t in tenants if t[0]})
    unnamed = tuple(n for n in names if draw(st.booleans()))
    branch = None
    if draw(st.booleans()):
        pages = (len(doc) - int(eagle)) // p
        branch = (draw(st.integers(0, len(tenants) - 1)), draw(st.integers(1, pages - 1)),
                  draw(token_ids(min_size=p, max_size=2 * p, vocab=4).map(lambda s: [t + 4 for t in s])))
    return TenantScenario(p, eagle, doc, tenants, unnamed, branch, draw(st.booleans()))


@dataclass
class Published:
    """What SGLang's events said, per tenant (engine facts kvalign names a divergence from)."""

    tenant: Tenant = (None, None)
    owners: dict[int, set[Tenant]] = field(default_factory=dict)  # engine hash -> tenants it was published for
    parents_elsewhere: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # LoRA pages published with another name than the request's

    def stored(self, ev: BlockStored) -> None:
        lora = self.tenant[0]
        if (ev.lora_name or None) != lora:
            self.names.append(f"a page of tenant (lora={lora!r}, cache_salt={self.tenant[1]!r}) was published with "
                              f"lora_name={ev.lora_name!r}")
        if ev.parent_block_hash is not None:
            parent_owners = self.owners.get(ev.parent_block_hash & U64_MASK, set())
            if parent_owners and self.tenant not in parent_owners:
                self.parents_elsewhere.append(f"a page of tenant {self.tenant} names as its parent a page of "
                                              f"{sorted(parent_owners, key=str)[0]}")
        for h in ev.block_hashes:
            self.owners.setdefault(h & U64_MASK, set()).add(self.tenant)

    def collisions(self) -> list[int]:
        return [h for h, owners in self.owners.items() if len(owners) > 1]


def _name(published: Published, unnamed: tuple[str, ...]) -> tuple[Cause, str] | None:
    """The cause SGLang's events show, the root first: a LoRA page without its name (or with another)
    makes every query of that tenant miss whatever else the events get right; then pages of two
    tenants under one hash; then a parent in another namespace. The other facts seen follow in the detail."""
    found: list[tuple[Cause, str]] = []
    if published.names:
        missing = next((n for n in published.names if n.endswith("lora_name=None")), None)
        fallback = f" (requests for {', '.join(unnamed)} carried no name: SGLang's adapter-id fallback)" if unnamed else ""
        found.append((Cause.LORA_NOT_IN_EVENTS, missing + fallback) if missing
                     else (Cause.LORA_NAME_MISMATCH, published.names[0] + fallback))
    collided = published.collisions()
    if collided:
        owners = sorted(published.owners[collided[0]], key=str)
        found.append((Cause.TENANT_HASH_COLLISION, f"SGLang published {len(collided)} page hash(es) for more than one "
                                                   f"tenant (e.g. {collided[0]} for {owners}): the router keeps one "
                                                   "entry per hash"))
    if published.parents_elsewhere:
        found.append((Cause.PARENT_OUTSIDE_NAMESPACE, published.parents_elsewhere[0]))
    if not found:
        return None
    (cause, why), *also = found
    return cause, why + "".join(f"; also {c.name}: {w}" for c, w in also)


def tenants_property(path: Any, make_cache: Callable[[int, bool], Any], sc: TenantScenario,
                     mutate: Mutate | None = None, *, load_adapters: bool = True) -> None:
    """Every tenant's overlap in the router equals SGLang's, after stores, a branch and a removal.

    ``mutate`` and ``load_adapters=False`` are for the negative controls: events changed before they
    are sent, and an engine that never loaded the adapters its unnamed requests use."""
    try:
        _tenants(path, make_cache, sc, mutate, load_adapters)
    except OracleUnavailable as exc:
        raise Mismatch("tenants", str(exc), Cause.PATH_UNAVAILABLE, sc) from None


def _tenants(path: Any, make_cache: Callable[[int, bool], Any], sc: TenantScenario, mutate: Mutate | None,
             load_adapters: bool) -> None:
    from kvalign.oracles.sglang import to_kvalign_event

    p, eagle = sc.page_size, sc.eagle
    worker = path.worker(p, eagle)
    if not worker.barrier():
        raise Mismatch("tenants", f"the relay never indexed a plain one-page SGLang event (Dynamo {path.version})",
                       Cause.PATH_UNAVAILABLE, sc)
    base = worker.token_space()
    shift = lambda tokens: [base + t for t in tokens]  # noqa: E731 - this example's own token range
    cache = make_cache(p, eagle)
    for name in sc.unnamed:
        cache.unnamed_requests.add(name)
        if load_adapters:  # SGLang's load_lora_adapter (or --lora-paths): the id -> name table
            cache.load_adapter(name)
    cache.take_raw_events()
    published, expected, ref_relay = Published(), _ExpectedIndex(p), Relay(p)

    def send(tenant: Tenant) -> None:
        raw = cache.take_raw_events()
        published.tenant = tenant
        if mutate is not None:
            raw = mutate(raw, published)
        events = [to_kvalign_event(e) for e in raw]
        for ev in events:
            if isinstance(ev, BlockStored):
                published.stored(ev)
                expected.seen.update(h & U64_MASK for h in ev.block_hashes)
            expected.apply(ev, events, ref_relay.convert(ev))
        if raw:
            worker.publisher.publish(raw)

    for i, tenant in enumerate(sc.tenants):
        for prompt in sc.prompts(i):
            cache.insert(shift(prompt), lora_name=tenant[0], cache_salt=tenant[1])
            send(tenant)
    if sc.evict:  # one prompt's whole pages: the least recently used tenant's node (SGLang picks it)
        cache.evict((len(sc.doc) - int(eagle)) // p * p)
        send((None, None))
    if not worker.barrier():
        raise Mismatch("tenants", "the relay stopped indexing after this scenario's batches", Cause.EVENTS_DROPPED, sc)
    for i, (lora, ns) in enumerate(sc.tenants):
        for prompt in sc.prompts(i):
            query = shift(prompt)
            engine = cache.match(query, lora_name=lora, cache_salt=ns) // p
            answered = worker.overlap(query, lora, ns)
            if engine == answered:
                continue
            detail = (f"tenant (lora={lora!r}, cache_salt={ns!r}), {len(prompt)}-token prompt: SGLang reuses {engine} "
                      f"pages, the router answers {answered}")
            named = _name(published, sc.unnamed) or _name_ingest_divergence(
                expected, {h: t for _p, h, t in worker.dump() if h in expected.seen}, p)
            cause, why = named if named else (Cause.UNKNOWN, "kvalign cannot name it from SGLang's events or the index")
            raise Mismatch("tenants", f"{detail}; {why}", cause, sc)
