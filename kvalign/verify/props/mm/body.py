"""The ``mm`` property: an image prompt's pages, keyed by SGLang and by Dynamo's router, block by block.

Both sides replace an image's placeholder tokens with pad values derived from the image's hash
before they hash the prompt into pages, so an image's KV can only be credited if both derive the
same values for the same number of tokens, and if the router can ingest the engine's events.
Each example drives the real code of both sides on CPU:

1. Dynamo's frontend preprocesses two chat requests with images (:mod:`kvalign.oracles.frontend_mm`):
   the router's sequence (``mm_routing_info.routing_token_ids``) and what the worker gets;
2. SGLang's multimodal path turns each worker request into the padded token ids its radix tree
   keys (:mod:`kvalign.oracles.sglang_mm`);
3. SGLang's radix cache stores the first request and publishes its events; Dynamo's real relay
   indexes them in a real ``KvRouter`` (:mod:`kvalign.oracles.router_path`).

Then, with the router hasher under test (default: the installed binding):

* **block by block**: block i of the router's hashes of the first request equals what the relay
  indexed for SGLang's page i, for every page SGLang stored;
* **credit**: the router's credit for the second request (walked over what the router indexed,
  and checked against the real ``KvRouter``'s own answer) equals SGLang's ``match_prefix``;
* **a changed image is not credited**: after a one-pixel change, neither side's credit reaches
  into that image's pages (with EAGLE, not into the page whose bigram window touches it).

A failure names its cause from what the two sides did with the images (:func:`name_mm_cause`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvalign.model.causes import Cause, classify_hash_mismatch
from kvalign.model.hashing import U64_MASK
from kvalign.model.index import PrefixIndex
from kvalign.model.mm_keys import Run, pad_runs, wide_tokens
from kvalign.model.relay import RouterStored
from kvalign.oracles.base import OracleUnavailable, RouterHasher
from kvalign.oracles.frontend_mm import Preprocessed
from kvalign.oracles.sglang_mm import EngineRequest
from kvalign.verify.props.mm.strategies import Image, MmScenario, wire_parts
from kvalign.verify.engine.properties import Mismatch
from kvalign.verify.engine.search import Tally

WORKER = 1

#: What happens to a preprocessed request between the frontend and the two sides: nothing, except in
#: a negative control (a frontend or worker that drops or alters part of it).
Transform = Callable[[Preprocessed], Preprocessed]


def as_sent(pre: Preprocessed) -> Preprocessed:
    """The request as Dynamo's frontend sent it."""
    return pre


@dataclass
class MmSystems:
    """The real pieces one ``mm`` example drives; a negative control swaps one of them."""

    frontend: Any  # FrontendPreprocessor
    sglang: Any  # SglangMultimodal
    path: Any  # RouterPath
    hasher: RouterHasher
    transform: Transform = as_sent
    #: the hasher is the installed router's own (so the real KvRouter's answer must equal the walk)
    real_hasher: bool = True
    cleared: set[tuple[int, bool]] = field(default_factory=set)


@dataclass(frozen=True)
class Side:
    """One request as both sides keyed it."""

    pre: Preprocessed  # mm_hashes: what the frontend computed; request: what the worker got
    engine: EngineRequest
    router: list[int]  # the router's sequence


def _clear(systems: MmSystems, worker: Any) -> None:
    """Empty the router's index for this worker (SGLang's own ``AllBlocksCleared``) and wait for it."""
    worker.publisher.publish([worker.publisher.clear()])
    if not worker.barrier():
        raise OracleUnavailable(f"Dynamo {systems.path.version}'s relay stopped indexing (a sentinel page after a "
                                "clear never reached the router)")


def _indexed_chain(dump: list[tuple[int | None, int, int]], stored: list[int]) -> dict[int, int]:
    """engine hash -> the router's local hash, for the engine's pages the router indexed."""
    wanted = set(stored)
    return {h: t for _p, h, t in dump if h in wanted}


def _router_credit(blocks: Sequence[int], dump: list[tuple[int | None, int, int]], stored: set[int]) -> int:
    """How many leading ``blocks`` the router's index holds, walked from the root over what it indexed."""
    index = PrefixIndex()
    for parent, h, local in dump:
        if h in stored:
            index.apply(WORKER, RouterStored(parent_hash=parent, blocks=[(h, local)]))
    return index.overlap(list(blocks)).get(WORKER, 0)


def _block_span(i: int, b: int, eagle: bool, runs: list[Run]) -> str:
    lo, hi = i * b, i * b + b + (1 if eagle else 0)
    touching = [k for k, r in enumerate(runs, 1) if r.start < hi and r.end > lo]
    what = f"image {', '.join(map(str, touching))} of {len(runs)}" if touching else "text"
    return f"tokens {lo}-{hi - 1}, {what}"


def name_mm_cause(side: Side, page_size: int, eagle: bool, *, indexed_all: bool, bad_block: int | None,
                  hasher: RouterHasher) -> tuple[Cause, str]:
    """Why the router's keys for ``side`` differ from SGLang's: (cause, the evidence in one sentence)."""
    engine, router = side.engine.padded, side.router
    e_runs, r_runs = pad_runs(engine), pad_runs(router)
    wide = wide_tokens(engine)
    if wide and not indexed_all:
        return Cause.MM_PAD_WIDTH, (f"SGLang's pad value {wide[0]} is wider than u32 (image pads are "
                                    f"{len(side.engine.items[0].pad_values) if side.engine.items else '?'} "
                                    "value(s) per image, up to 62 bits), and the router never indexed that "
                                    "request's event batch")
    if e_runs and not r_runs:
        return Cause.MM_ROUTING_SKIPPED, (f"the router's sequence has no image runs ({len(router)} tokens, one "
                                          f"placeholder per image), SGLang's has {len(e_runs)}")
    if len(e_runs) != len(r_runs) or any(len(a.values) != len(b.values) for a, b in zip(e_runs, r_runs)):
        return Cause.MM_PLACEHOLDER_COUNT, (f"image runs: the frontend {[len(r.values) for r in r_runs]} tokens, "
                                            f"SGLang {[len(r.values) for r in e_runs]}")
    for k, (e, r) in enumerate(zip(e_runs, r_runs)):
        if e.values != r.values:
            item = side.engine.items[k] if k < len(side.engine.items) else None
            sent = side.pre.mm_hashes[k] if side.pre.mm_hashes and k < len(side.pre.mm_hashes) else None
            values = f"frontend {r.values[0]}{'...' if len(set(r.values)) > 1 else ' x' + str(len(r.values))}, " \
                     f"SGLang {list(dict.fromkeys(e.values))[:4]}"
            if sent is not None and (side.engine.forwarded is None or item is None or item.hash != int(sent, 16)):
                return Cause.MM_HASH_NOT_FORWARDED, (f"image {k + 1}: the frontend sent hash {sent}, SGLang keyed "
                                                     f"the image by its own hash "
                                                     f"{hex(item.hash) if item and item.hash is not None else None} "
                                                     f"({values})")
            return Cause.MM_PAD_VALUES, f"image {k + 1}, hash {sent}: {values}"
    if bad_block is not None and eagle:
        lookahead = bad_block * page_size + page_size
        if any(r.start == lookahead for r in e_runs):
            return Cause.MM_EAGLE_WINDOW, (f"block {bad_block}'s bigram window ends on the first token of an image "
                                           f"(token {lookahead}); the sequences agree token by token")
    if not indexed_all:
        return Cause.EVENTS_DROPPED, "the router never indexed some of SGLang's pages for this request"
    usable = router[: (len(engine) // page_size) * page_size + (1 if eagle else 0)]
    got = [int(h) for h in hasher(usable, page_size, side.pre.block_mm_infos or None, None, eagle, None)]
    return classify_hash_mismatch(got, usable, page_size, eagle=eagle), "the sequences agree token by token"


def _changed_image_start(sc: MmScenario, second: EngineRequest) -> int | None:
    """Where the one-pixel-changed image starts in the second request's expanded prompt."""
    if sc.relation != "pixel":
        return None
    images = sc.images("second")
    changed = [k for k, img in enumerate(images) if isinstance(img, Image) and img.dot is not None]
    if not changed or changed[0] >= len(second.items):
        return None
    offsets = second.items[changed[0]].offsets
    return offsets[0][0] if offsets else None


def mm_property(systems: MmSystems, make_cache: Callable[[int, bool], Any], sc: MmScenario) -> None:
    """One example: the first request cached and indexed, the second routed against it."""
    p, eagle = sc.page_size, sc.eagle
    sides = []
    for parts in (sc.first, sc.second):
        pre = systems.transform(systems.frontend.preprocess(p, wire_parts(parts)))
        sides.append(Side(pre, systems.sglang.process(pre.request), pre.router_tokens))
    first, second = sides
    worker = systems.path.worker(p, eagle)
    _clear(systems, worker)
    cache = make_cache(p, eagle)
    cache.insert(first.engine.padded)
    raw = cache.take_raw_events()
    stored = [h & U64_MASK for ev in raw if type(ev).__name__.startswith("BlockStored") for h in ev.block_hashes]
    worker.publisher.publish(raw)
    if not worker.barrier():
        raise Mismatch("mm", "the relay stopped indexing after the first request's batch", Cause.EVENTS_DROPPED, sc)
    dump = worker.dump()
    indexed = _indexed_chain(dump, stored)
    indexed_all = len(indexed) == len(stored)

    # Block by block: the router's hashes of the first request against what it indexed of SGLang's pages.
    blocks = [int(h) for h in systems.hasher(first.router, p, first.pre.block_mm_infos or None, None, eagle, None)]
    runs = pad_runs(first.engine.padded)
    for i, h in enumerate(stored):
        mine = blocks[i] if i < len(blocks) else None
        if indexed.get(h) != mine:
            cause, why = name_mm_cause(first, p, eagle, indexed_all=indexed_all, bad_block=i, hasher=systems.hasher)
            theirs = "never indexed" if h not in indexed else f"indexed as {indexed[h]}"
            raise Mismatch("mm", f"first request, block {i} ({_block_span(i, p, eagle, runs)}): the router hashes "
                           f"{mine}, SGLang's page {i} was {theirs} ({len(indexed)} of {len(stored)} pages indexed); "
                           f"{why}", cause, sc)

    # Credit: the router's answer for the second request against SGLang's reuse.
    engine = cache.match(second.engine.padded) // p
    query = [int(h) for h in systems.hasher(second.router, p, second.pre.block_mm_infos or None, None, eagle, None)]
    router = _router_credit(query, dump, set(stored))
    if systems.real_hasher:
        real = worker.overlap(second.router, None, None)
        if real != router:
            raise Mismatch("mm", f"the real KvRouter credits {real} blocks where kvalign's walk of its own index dump "
                           f"gives {router}", Cause.UNKNOWN, sc)
    if engine != router:
        cause, why = name_mm_cause(second, p, eagle, indexed_all=indexed_all, bad_block=min(engine, router),
                                   hasher=systems.hasher)
        raise Mismatch("mm", f"second request ({sc.relation}): SGLang reuses {engine} pages, the router credits "
                       f"{router}; {why}", cause, sc)
    start = _changed_image_start(sc, second.engine)
    if start is not None:
        limit = max(start - (1 if eagle else 0), 0) // p
        if engine > limit:
            raise Mismatch("mm", f"after a one-pixel change of the image at token {start}, SGLang reuses {engine} "
                           f"pages (at most {limit} precede the image)", Cause.MM_IMAGE_REUSED, sc)


def run_mm_search(systems: MmSystems, make_cache: Callable[[int, bool], Any], *, eagle: bool, examples: int,
                  seed: int | None = None, page_sizes: tuple[int, ...] | None = None,
                  tally: Tally | None = None) -> tuple[int, int, Mismatch | None]:
    """Search image scenarios for a mismatch (Hypothesis, shrinking to the smallest): (generated examples,
    of them the failing ones, the shrunk mismatch); the shrink steps in ``tally``."""
    from kvalign.verify.engine.search import run_search
    from kvalign.verify.props.mm.strategies import MM_PAGE_SIZES, mm_scenarios

    strategy = mm_scenarios(eagle=eagle, page_sizes=page_sizes or MM_PAGE_SIZES)
    return run_search(lambda sc: mm_property(systems, make_cache, sc), strategy, examples, seed=seed, tally=tally)




def run_mm_rows(systems: Any, modes: tuple[str, ...], examples: int, seed: int | None = None,
                page_size: int | None = None, make_mm: Callable[..., MmSystems] | None = None) -> list[Any]:
    """``check``'s ``mm`` rows (one per mode, base variant)."""
    from kvalign.verify.props.mm.strategies import MM_PAGE_SIZES
    from kvalign.verify.engine.rows import RowResult

    page_sizes = (page_size,) if page_size else MM_PAGE_SIZES
    started = time.perf_counter()
    try:
        mm = (make_mm or open_mm_systems)(systems, page_sizes)
    except OracleUnavailable as exc:
        return [RowResult("mm", mode, "base", 0, 1, time.perf_counter() - started, Cause.PATH_UNAVAILABLE.value,
                          Cause.PATH_UNAVAILABLE.name, str(exc)) for mode in modes]
    rows = []
    try:
        for mode in modes:
            start, tally = time.perf_counter(), Tally()
            calls, failures, found = run_mm_search(mm, systems.make_cache, eagle=mode == "eagle", examples=examples,
                                                   seed=seed, page_sizes=page_sizes, tally=tally)
            row = RowResult("mm", mode, "base", calls, failures, time.perf_counter() - start)
            row.shrink_steps = tally.shrink_steps
            if found is not None:
                row.cause, row.cause_name, row.detail = found.cause.value, found.cause.name, found.detail
                row.counterexample = describe(found.example)
            rows.append(row)
    finally:
        close_mm_systems(mm)
    return rows


def open_mm_systems(systems: Any, page_sizes: tuple[int, ...]) -> MmSystems:
    """Start the frontend and SGLang's multimodal path (the router path is the check's own)."""
    from kvalign.oracles.frontend_mm import FrontendPreprocessor
    from kvalign.oracles.sglang_mm import SglangMultimodal

    frontend = FrontendPreprocessor(page_sizes)
    try:
        sglang = SglangMultimodal(frontend.model_dir)
        return MmSystems(frontend, sglang, systems.router_path(), systems.hasher,
                         real_hasher=_is_installed_hasher(systems.hasher))
    except BaseException:
        frontend.close()
        raise


def _is_installed_hasher(hasher: RouterHasher) -> bool:
    from kvalign.oracles.dynamo import load_router_hasher

    try:
        return hasher is load_router_hasher()
    except OracleUnavailable:
        return False


def close_mm_systems(mm: MmSystems) -> None:
    mm.sglang.close()
    mm.frontend.close()


def describe(sc: MmScenario) -> dict[str, Any]:
    """A counterexample as a reader (and ``report``) wants it: page size, relation, the parts in words."""
    def part(k: str, v: Any) -> str:
        if isinstance(v, Image):
            return f"image {v.width}x{v.height} seed {v.seed}" + (f" pixel {v.dot} changed" if v.dot else "")
        return f"text {v!r}"
    return {"page_size": sc.page_size, "eagle": sc.eagle, "relation": sc.relation,
            "first": [part(k, v) for k, v in sc.first], "second": [part(k, v) for k, v in sc.second]}
