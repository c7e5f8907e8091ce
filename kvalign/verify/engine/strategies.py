"""Hypothesis strategies for alignment properties: composable values, tiny API.

Two token alphabets matter: the full u32 range (catches byte-order and width bugs) and a tiny
vocabulary (makes prompts share prefixes, so overlap, page boundaries and bigram edges are hit
constantly). Block sizes favour the serving sizes SGLang uses ({1, 2, 4, 16}) but reach 128.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from kvalign.model.hashing import U32_MAX, U64_MASK

PAGE_SIZES = (1, 2, 4, 16)
NAMES = ("loraA", "tenant-1", "ü-名前", " ")

Tenant = tuple[str | None, str | None]  # (lora_name, cache_namespace / cache_salt)


def token_ids(*, min_size: int = 0, max_size: int = 64, vocab: int | None = None) -> st.SearchStrategy[list[int]]:
    """Token-id lists over a small vocabulary (``vocab``) or, by default, the full u32 range."""
    elem = st.integers(0, vocab - 1) if vocab else st.integers(0, U32_MAX)
    return st.lists(elem, min_size=min_size, max_size=max_size)


def names() -> st.SearchStrategy[str | None]:
    """LoRA / namespace names: absent, empty (means absent), fixed and arbitrary unicode."""
    return st.one_of(st.none(), st.just(""), st.sampled_from(NAMES), st.text(min_size=1, max_size=12))


def mm_infos(max_blocks: int) -> st.SearchStrategy[list[dict[str, Any] | None]]:
    """Per-block multimodal infos: None entries, 0-3 objects, any u64 ``mm_hash``."""
    obj = st.builds(lambda h: {"mm_hash": h, "offsets": []}, st.integers(0, U64_MASK))
    info = st.one_of(st.none(), st.builds(lambda objs: {"mm_objects": objs}, st.lists(obj, max_size=3)))
    return st.lists(info, max_size=max_blocks + 1)


@dataclass(frozen=True)
class HashCase:
    """One input to the router hasher."""

    tokens: list[int]
    block_size: int
    eagle: bool
    lora_name: str | None = None
    cache_namespace: str | None = None
    mm_infos: list[dict[str, Any] | None] | None = None


@st.composite
def hash_cases(draw: st.DrawFn, *, eagle: bool | None = None, lora: bool = True, namespace: bool = True, mm: bool = True,
               block_size: int | None = None) -> HashCase:
    """Router-hasher inputs, with block-count edge lengths N in {0, B-1, B, B+1, 2B, 2B+1} favoured.
    ``block_size`` pins B (``check --page-size``); by default B ranges over 1..128."""
    b = block_size or draw(st.one_of(st.sampled_from(PAGE_SIZES), st.integers(1, 128)))
    edge = st.sampled_from(sorted({max(0, n) for n in (0, b - 1, b, b + 1, 2 * b, 2 * b + 1)}))
    n = draw(st.one_of(edge, st.integers(0, 4 * b + 2)))
    small = draw(st.booleans())
    toks = draw(token_ids(min_size=n, max_size=n, vocab=8 if small else None))
    return HashCase(
        tokens=toks,
        block_size=b,
        eagle=draw(st.booleans()) if eagle is None else eagle,
        lora_name=draw(names()) if lora else None,
        cache_namespace=draw(names()) if namespace else None,
        mm_infos=draw(st.one_of(st.none(), mm_infos(n // b + 1))) if mm else None,
    )


@dataclass(frozen=True)
class Scenario:
    """Requests cached by one engine worker, then a query prompt routed against them."""

    page_size: int
    eagle: bool
    inserts: list[tuple[list[int], Tenant]] = field(default_factory=list)
    query: tuple[list[int], Tenant] = ((), (None, None))  # type: ignore[assignment]


def tenants(*, lora: bool, namespace: bool) -> st.SearchStrategy[Tenant]:
    pool_l = st.sampled_from([None, "loraA", "loraB", "ü-名前"]) if lora else st.none()
    pool_n = st.sampled_from([None, "tenant-1", "tenant-2", "ü-名前"]) if namespace else st.none()
    return st.tuples(pool_l, pool_n)


@st.composite
def scenarios(
    draw: st.DrawFn, *, eagle: bool, lora: bool = False, namespace: bool = False, page_sizes: tuple[int, ...] = PAGE_SIZES
) -> Scenario:
    """A document, requests that extend or branch off it, and a query sharing a prefix with it.

    Tiny vocabulary so branches collide and splits happen; the query usually carries the first
    request's tenant (the interesting case) and sometimes another one (must not match).
    """
    p = draw(st.sampled_from(page_sizes))
    doc = draw(token_ids(max_size=6 * p + 2, vocab=4))
    ten = tenants(lora=lora, namespace=namespace)
    first = draw(ten)
    inserts = [(doc, first)]
    for _ in range(draw(st.integers(0, 3))):
        cut = draw(st.integers(0, len(doc)))
        inserts.append((doc[:cut] + draw(token_ids(max_size=3 * p, vocab=4)), draw(st.one_of(st.just(first), ten))))
    cut = draw(st.integers(0, len(doc)))
    query = doc[:cut] + draw(token_ids(max_size=2 * p + 1, vocab=4))
    return Scenario(p, eagle, inserts, (query, draw(st.one_of(st.just(first), st.just(first), ten))))


#: Page sizes the ingest property draws. Each costs one registered worker + relay + router in the
#: real runtime, so the set stays small; 1 is left out because ai-dynamo-runtime 1.0.x's KvRouter
#: refuses block_size 1 at construction (a loud start-up failure, not a silent misalignment).
INGEST_PAGE_SIZES = (2, 4)


@dataclass(frozen=True)
class IngestScenario:
    """A scenario whose engine events reach the router through the real worker relay.

    ``clear_after`` = i: the engine drops its whole cache after insert i (AllBlocksCleared) and
    starts empty; ``evict_tokens`` > 0 evicts that many slots after the inserts (BlockRemoved
    events); ``one_batch`` puts every step's events into one ZMQ batch (mixed stores, removals,
    clears) instead of one batch per step.
    """

    scenario: Scenario
    evict_tokens: int = 0
    one_batch: bool = False
    clear_after: int | None = None


@st.composite
def ingest_scenarios(draw: st.DrawFn, *, eagle: bool, lora: bool = False, namespace: bool = False,
                     page_sizes: tuple[int, ...] = INGEST_PAGE_SIZES) -> IngestScenario:
    sc = draw(scenarios(eagle=eagle, lora=lora, namespace=namespace, page_sizes=page_sizes))
    evict = draw(st.one_of(st.just(0), st.integers(1, 8 * sc.page_size)))
    clear_after = draw(st.one_of(st.none(), st.integers(0, len(sc.inserts) - 1)))
    return IngestScenario(sc, evict, draw(st.booleans()), clear_after)
