"""Diagnose one prompt against one worker's capture: where router and engine keys part, and why.

The router credits a worker with the leading blocks of a prompt whose keys it finds in the index it
rebuilt from that worker's events. ``diagnose`` replays the capture twice over in one pass — once
with the router's settings, once with the engine's own framing read from its events (block size,
bigram pages, LoRA name and cache namespace) — and compares, block by block:

* the router's prediction (overlap, ``kv_hit_rate``) under the settings given;
* what a correctly aligned router would see: the overlap the engine actually has;
* what the engine ever stored for this prompt (from the events, including later removals);
* pages the engine stored whose windows are this prompt's tokens at an unaligned offset (a
  prompt shifted by k tokens, where k is the number of *extra leading tokens the prompt has*
  compared with the engine's sequence: +1 for a BOS the engine's sequence lacks, negative when the
  prompt lacks leading tokens the engine has) or that hang under a parent the stream never
  delivered (a gap: a batch the router never applied, which Dynamo does not resync).

The first block where the router loses credit is the *first divergent block*, shown with both
token windows and both keys, and the reason is named from :class:`kvalign.model.causes.Cause`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvalign.streams.capture import Batch, Cleared, Removed, capture_block_size, u64_list
from kvalign.streams.diagnose_mm import mm_evidence
from kvalign.model.mm_keys import pad_runs
from kvalign.streams.engine_reuse import explain_engine_reuse, read_capture
from kvalign.model.causes import Cause
from kvalign.model.hashing import as_u32_tokens, block_hashes, salt_seed
from kvalign.model.index import router_kv_hit_rate
from kvalign.model.relay import RELAY_TIERS
from kvalign.streams.replay import WorkerReplay, replay_capture, resolve_block_size
from kvalign.streams.replay_index import ReplayIndex, StoredPages, chain_nodes
from kvalign.model.sglang_keys import engine_block_hashes, matchable_pages

WORKER = 1
_xxh3 = xxhash.xxh3_64_intdigest
#: SGLang 0.5.23's ``UnifiedRadixCache.init_hicache`` (mem_cache/unified_radix_cache.py:576): a host-only
#: stretch shorter than this many KV slots is not loaded back but re-prefilled (tests/unit/streams/test_diagnose.py
#: reads it from the installed SGLang's source).
LOAD_BACK_THRESHOLD = 10


@dataclass(frozen=True)
class RouterSettings:
    """How the router under test hashes prompts (``block_size`` None = the engine's)."""

    block_size: int | None = None
    eagle: str = "auto"  # auto | on | off
    lora: str | None = None
    namespace: str | None = None


@dataclass
class PageSeen:
    """An engine page whose token window occurs in the prompt."""

    ext: int  # SGLang block hash, as u64
    parent_ext: int | None
    node: int | None  # None: its event was an orphan (parent never seen)
    depth: int | None
    offsets: list[int]  # prompt offsets where its window occurs
    local: int  # the router key the relay computed for it
    lora: str | None
    namespace: str | None
    seq: int | None
    removed_seq: int | None = None
    cleared_seq: int | None = None


@dataclass
class BlockView:
    """One side of the first divergent block."""

    index: int
    start: int
    end: int
    tokens: list[int | None]
    hash: int | None  # router local hash (the key the index is matched on)
    engine_block_hash: int | None = None  # SGLang's own hash of the page (signed, as SGLang logs it)
    stored_seq: int | None = None
    removed_seq: int | None = None


@dataclass
class Diagnosis:
    capture: str
    prompt_tokens: int
    router: dict[str, Any]
    engine: dict[str, Any]
    first_divergent: int | None
    router_block: BlockView | None
    engine_block: BlockView | None
    cause: Cause | None
    detail: str
    shift: int | None = None  # the prompt's extra leading tokens vs the engine's sequence (PROMPT_SHIFT)
    confidence: str | None = None  # SEQUENCE_GAP: confirmed | likely | possible
    notes: list[str] = field(default_factory=list)
    capture_stats: dict[str, Any] = field(default_factory=dict)
    #: named problems beside the first divergence (``HOST_CREDIT_NOT_SERVABLE``: the router's keys agree,
    #: its host credit is for pages SGLang will re-prefill)
    findings: list[str] = field(default_factory=list)
    #: with ``engine_reused``: the pages the engine reused that its own stream did not hold (ENGINE_EVENTS_*)
    engine_reuse: dict[str, Any] | None = None


@dataclass(frozen=True)
class Orphan:
    """A ``BlockStored`` whose parent the stream never delivered: proof that a lost batch stored blocks."""

    seq: int | None
    parent_ext: int  # u64
    blocks: int


_MAX_ORPHANS = 10_000


class _PromptPages:
    """Replay observer: remembers the engine pages whose windows occur in the prompt."""

    def __init__(self, tokens: list[int], block_size: int):
        self.tokens, self.block_size = tokens, block_size
        self._buf = memoryview(as_u32_tokens(tokens)).cast("B")
        self._lookups: dict[tuple[str | None, str | None, bool], dict[int, list[int]]] = {}
        self.depth: dict[int, int] = {}
        self.pages: dict[int, PageSeen] = {}
        self.roots: dict[int, tuple[int, bytes, int, int | None]] = {}  # node -> (ext, window, local, seq)
        self.framing: Counter[bool] = Counter()  # bigram? -> events
        self.seq: int | None = None
        self.orphans: list[Orphan] = []  # stores under a parent the stream never delivered (capped)
        self.orphan_events = 0
        #: engine hash of a page in the prompt -> the router tiers its stores and removals leave it in
        self.tiers: dict[int, set[str]] = {}

    def _lookup(self, lora: str | None, ns: str | None, bigram: bool) -> dict[int, list[int]]:
        key = (lora, ns, bigram)
        found = self._lookups.get(key)
        if found is None:
            win = (self.block_size + 1 if bigram else self.block_size) * 4
            seed = salt_seed(lora, ns)
            found = {}
            for j in range(0, len(self._buf) - win + 1, 4):
                found.setdefault(_xxh3(self._buf[j : j + win], seed), []).append(j // 4)
            self._lookups[key] = found
        return found

    def __call__(self, sp: StoredPages) -> None:
        if sp.event.h:
            self.framing[sp.bigram] += 1
        if sp.nodes is None and sp.event.p is not None:
            self.orphan_events += 1
            if len(self.orphans) < _MAX_ORPHANS:
                self.orphans.append(Orphan(self.seq, sp.event.p, len(sp.event.h) // 8))
        nodes, d0 = sp.nodes, 0
        if nodes:
            d0 = 0 if sp.parent_node is None else self.depth.get(sp.parent_node, 0)
            self.depth.update(zip(nodes, range(d0 + 1, d0 + 1 + len(nodes))))
            if sp.parent_node is None:
                win = (self.block_size + 1 if sp.bigram else self.block_size) * 4
                self.roots[nodes[0]] = (sp.ext[0], sp.raw[:win], sp.local[0], self.seq)
        look = self._lookup(sp.event.lora, sp.namespace, sp.bigram)
        parent = sp.event.p
        for i, h in enumerate(sp.local):
            offsets = look.get(h)
            if offsets is None:
                continue
            tier = RELAY_TIERS.get(sp.event.m)
            if tier is not None:
                self.tiers.setdefault(sp.ext[i], set()).add(tier)
            self.pages[sp.ext[i]] = PageSeen(
                ext=sp.ext[i], parent_ext=sp.ext[i - 1] if i else parent,
                node=nodes[i] if nodes else None, depth=d0 + 1 + i if nodes else None, offsets=offsets,
                local=h, lora=sp.event.lora, namespace=sp.namespace, seq=self.seq,
            )

    def before(self, batch: Batch) -> None:
        self.seq = batch.seq

    def after(self, batch: Batch, applied: bool) -> None:
        if not applied:
            return
        for ev in batch.ev:
            if type(ev) is Removed:
                tier = RELAY_TIERS.get(ev.m)
                for h in u64_list(ev.h):
                    page = self.pages.get(h)
                    if page is not None:
                        page.removed_seq = batch.seq
                    self.tiers.get(h, set()).discard(tier)
            elif type(ev) is Cleared:
                for page in self.pages.values():
                    page.cleared_seq = batch.seq
                self.tiers.clear()


def _window(tokens: list[int], index: int, block_size: int, eagle: bool) -> tuple[int, int, list[int | None]]:
    start = index * block_size
    end = min(start + block_size + (1 if eagle else 0), len(tokens))
    return start, end, list(tokens[start:end])


def diagnose(capture: str, tokens: list[int], router: RouterSettings, *, engine_reused: int | None = None,
             routed_at: int | None = None) -> Diagnosis:
    """Compare the router's keys for ``tokens`` with what the captured engine stored.

    ``engine_reused``: the tokens the engine reported reusing for this prompt (``cached_tokens``).
    When its own stream did not hold those pages in the prompt's chain after the capture's first
    ``routed_at`` batches (default: all), the cause is the engine's events
    (:mod:`kvalign.streams.engine_reuse`): no router keying can credit pages the engine never
    published, so no router-side cause is looked for."""
    as_u32_tokens(tokens)  # bad prompt ids fail before any work
    # a worker that stored nothing yet (fresh or cleared) still has an answer: overlap 0
    engine_b = capture_block_size(capture) or resolve_block_size([capture], router.block_size)
    router_b = router.block_size or engine_b
    seen = _PromptPages(tokens, engine_b)
    idx_e = ReplayIndex(engine_b, seen)
    idx_r = idx_e if router_b == engine_b else ReplayIndex(router_b)
    rep = replay_capture(idx_e, capture, "engine", WORKER, before_batch=seen.before, after_batch=seen.after)
    if idx_r is not idx_e:
        replay_capture(idx_r, capture, "router", WORKER)
    engine_eagle = seen.framing.most_common(1)[0][0] if seen.framing else False
    router_eagle = engine_eagle if router.eagle == "auto" else router.eagle == "on"

    h_r = block_hashes(tokens, router_b, eagle=router_eagle, lora_name=router.lora, cache_namespace=router.namespace)
    overlap_r = idx_r.overlap(h_r).get(WORKER, 0)

    roots = [p for p in seen.pages.values() if p.depth == 1 and 0 in p.offsets]
    seeds = Counter((p.lora or None, p.namespace or None) for p in roots)
    router_seed = (router.lora or None, router.namespace or None)
    lora_e, ns_e = router_seed if (router_seed in seeds or not seeds) else seeds.most_common(1)[0][0]
    h_e = block_hashes(tokens, engine_b, eagle=engine_eagle, lora_name=lora_e, cache_namespace=ns_e)
    path_e = chain_nodes(h_e)
    overlap_e = idx_e.overlap(h_e).get(WORKER, 0)
    by_node = {p.node: p for p in seen.pages.values() if p.node is not None}
    ever = 0
    while ever < len(path_e) and path_e[ever] in by_node:
        ever += 1

    def rate(overlap: int, block_size: int) -> float | None:
        value = router_kv_hit_rate(overlap, len(tokens), block_size)
        return None if value is None else round(value, 6)

    d = Diagnosis(
        capture=capture, prompt_tokens=len(tokens),
        router={"block_size": router_b, "eagle": router_eagle, "eagle_mode": router.eagle, "lora": router.lora,
                "namespace": router.namespace, "blocks": len(h_r), "overlap": overlap_r,
                "kv_hit_rate": rate(overlap_r, router_b)},
        engine={"block_size": engine_b, "eagle": engine_eagle, "lora": lora_e, "namespace": ns_e,
                "blocks": len(h_e), "overlap": overlap_e, "kv_hit_rate": rate(overlap_e, engine_b),
                "ever_stored": ever, "holds": overlap_e, "stored_events": sum(seen.framing.values())},
        first_divergent=None, router_block=None, engine_block=None, cause=None, detail="",
        notes=_capture_notes(rep), capture_stats=_capture_stats(rep),
    )

    matchable = matchable_pages(len(tokens), engine_b, eagle=engine_eagle)  # SGLang's scheduler cap
    d.findings += _host_credit_not_servable(seen, [by_node.get(n) for n in path_e[:min(ever, matchable)]], engine_b,
                                            engine_eagle)

    def router_view(i: int) -> BlockView:
        s, e, toks = _window(tokens, i, router_b, router_eagle)
        return BlockView(i, s, e, toks, h_r[i] if i < len(h_r) else None)

    def engine_view(i: int) -> BlockView:
        s, e, toks = _window(tokens, i, engine_b, engine_eagle)
        page = by_node.get(path_e[i]) if i < len(path_e) else None
        return BlockView(i, s, e, toks, h_e[i] if i < len(h_e) else None,
                         _signed(page.ext) if page else None, page.seq if page else None,
                         page.removed_seq if page else None)

    def found(i: int, cause: Cause, detail: str, engine: BlockView | None = None) -> Diagnosis:
        d.first_divergent, d.cause, d.detail = i, cause, detail
        d.router_block, d.engine_block = router_view(i), engine or engine_view(i)
        return d

    if engine_reused is not None:
        reuse = explain_engine_reuse(read_capture(capture), tokens, engine_reused, engine_b, eagle=engine_eagle,
                                     routed_at=routed_at, namespace=ns_e, lora=lora_e)
        if reuse is not None:
            d.engine_reuse = reuse.as_json()
            return found(reuse.first, reuse.cause, reuse.detail)
    units = "bigrams" if engine_eagle else "tokens"
    if seen.framing:
        if router_b != engine_b:
            return found(0, Cause.BLOCK_SIZE,
                         f"the engine publishes pages of {engine_b} {units} but the router's kv_block_size is "
                         f"{router_b}; Dynamo's relay drops every event whose block_size differs, so the router "
                         f"indexes nothing from this worker (set the router's block size to {engine_b})")
        if router_eagle != engine_eagle:
            if engine_eagle:
                return found(0, Cause.ROUTER_EAGLE_OFF,
                             f"the engine keys pages by bigrams (EAGLE): a page of {engine_b} bigrams spans "
                             f"{engine_b + 1} tokens, but the router hashes {router_b}-token windows, so no key "
                             "matches (the router needs enable_eagle: --router-eagle on)")
            return found(0, Cause.ROUTER_EAGLE_ON,
                         f"the engine stores plain pages of {engine_b} tokens, but the router hashes "
                         f"{router_b + 1}-token EAGLE windows, so no key matches (enable_eagle must be off "
                         "for this worker)")
    if not h_r:
        need = router_b + 1 if router_eagle else router_b
        return found(0, Cause.PROMPT_TOO_SHORT,
                     f"the prompt has {len(tokens)} tokens; with block size {router_b}"
                     f"{' and EAGLE windows' if router_eagle else ''} the router needs at least {need} "
                     "tokens for one block, so it hashes none and can credit no cached block")
    if (lora_e, ns_e) != router_seed:
        cause = (Cause.LORA_DROPPED if lora_e and not router.lora and ns_e == (router.namespace or None) else
                 Cause.NAMESPACE_DROPPED if ns_e and not router.namespace and lora_e == (router.lora or None) else
                 Cause.SEED_DRIFT)
        return found(0, cause,
                     f"the engine stored this prompt under lora={lora_e!r}, namespace={ns_e!r} but the router "
                     f"hashes with lora={router.lora!r}, namespace={router.namespace!r}; both enter the hash "
                     "seed, so every key differs")
    if overlap_r == len(h_r):
        d.detail = f"router and engine agree on all {len(h_r)} blocks of this prompt"
        return d
    i = overlap_r
    if i < ever:
        page = by_node[path_e[i]]
        if page.removed_seq is not None:
            when = f"removed by BlockRemoved at seq {page.removed_seq}"
        elif page.cleared_seq is not None:
            when = f"dropped by AllBlocksCleared at seq {page.cleared_seq}"
        else:
            when = "no longer held"
        return found(i, Cause.EVICTED,
                     f"the engine stored block {i} (SGLang hash {_signed(page.ext)}, seq {page.seq}) and then "
                     f"evicted it ({when}); the router correctly stops crediting at block {i}")
    mm = mm_evidence(capture, tokens, engine_b) if rep.malformed or pad_runs(tokens) else None
    if mm is not None and mm.cause is not None:  # pages of the prompt the relay could not have indexed
        held = min(mm.common - (1 if engine_eagle else 0), len(tokens)) // engine_b  # the engine holds them
        d.engine.update(overlap=held, holds=held, ever_stored=held, kv_hit_rate=rate(held, engine_b))
        return found(i, mm.cause, mm.detail)
    gap = _gap_evidence(seen, tokens, h_e, path_e, by_node, i, rep, engine_b, engine_eagle, ns_e)
    if isinstance(gap, _Gap):
        view = engine_view(i)
        if gap.block_hash is not None:
            view.engine_block_hash = _signed(gap.block_hash)
        d.confidence = gap.confidence
        d.engine["holds"] = max(gap.holds, overlap_e)
        return found(i, Cause.SEQUENCE_GAP, gap.detail, view)
    shift = _shift_evidence(seen, engine_b)
    if shift is not None:
        k_engine, page = shift  # engine position - prompt position of the same tokens
        k = -k_engine  # reported: the prompt's extra leading tokens
        d.shift = k
        n = abs(k)
        tokens_word = "token" if n == 1 else "tokens"
        lead = (f"this prompt has {n} extra leading {tokens_word} that the engine's sequence lacks" if k > 0 else
                f"this prompt lacks {n} leading {tokens_word} that the engine's sequence has (a BOS or "
                "template prefix the router's prompt does not carry)")
        start = min(page.offsets)
        return found(i, Cause.PROMPT_SHIFT,
                     f"{lead}, so k = {k:+d}: the engine's block {page.depth - 1} holds prompt tokens "
                     f"[{start}, {start + engine_b + engine_eagle}) instead of [{(page.depth - 1) * engine_b}, "
                     f"{(page.depth - 1) * engine_b + engine_b + engine_eagle}), and every page boundary differs",
                     _shifted_view(seen, tokens, i, k_engine, engine_b, engine_eagle))
    if mm is not None:
        d.notes.append(mm.detail)
    d.detail = (f"router and engine agree: the engine never stored block {i} of this prompt "
                f"({overlap_r}/{len(h_r)} blocks cached)")
    if gap:  # lost batches after the last credited block, but nothing shows what they stored
        d.detail += (f"; but the stream lost batches after block {i - 1} was stored ({gap}) and nothing later "
                     f"shows what they held, so a lost store of block {i} cannot be ruled out" if i else
                     f"; but the stream lost batches ({gap}) and nothing later shows what they held, so a lost "
                     f"store of block {i} cannot be ruled out")
    return d


def _host_credit_not_servable(seen: _PromptPages, chain: list[PageSeen | None], b: int, eagle: bool) -> list[str]:
    """HOST_CREDIT_NOT_SERVABLE for this prompt, when it applies: past the pages the engine holds on
    device, a stretch it holds on host only, too short for SGLang to load back, inside the pages SGLang's
    scheduler matches (``chain`` stops at its cap: a page past it is computed again whatever its tier). Dynamo's router credits
    each of those blocks (host weight 0.75 by default); SGLang re-prefills them."""
    tiers = [seen.tiers.get(p.ext, set()) if p else set() for p in chain]
    device = next((i for i, t in enumerate(tiers) if "device" not in t), len(tiers))
    end = device
    while end < len(tiers) and "host_pinned" in tiers[end]:
        end += 1
    slots = (end - device) * b
    if end == device or slots >= LOAD_BACK_THRESHOLD:
        return []
    blocks = f"block {device}" if end - device == 1 else f"blocks {device}..{end - 1}"
    return [f"{Cause.HOST_CREDIT_NOT_SERVABLE.name}: the engine holds {blocks} of this prompt on host only (medium "
            f"CPU_PINNED), past {device} device block(s); the router credits them as host hits, but that stretch is "
            f"{slots} {'bigram' if eagle else 'token'}s, below SGLang's load_back_threshold ({LOAD_BACK_THRESHOLD}), "
            "so SGLang re-prefills it instead of loading it back (SGLang 0.5.23; it holds only with HiCache on and "
            f"page sizes below {LOAD_BACK_THRESHOLD})"]


def _signed(h: int | None) -> int | None:
    """SGLang prints its block hashes as signed int64; show them the same way."""
    return None if h is None else (h - (1 << 64) if h >= 1 << 63 else h)


@dataclass(frozen=True)
class _Gap:
    """Evidence that a batch the router never applied stored the prompt's next block."""

    confidence: str  # confirmed | likely | possible
    detail: str
    block_hash: int | None  # SGLang's hash of that block (u64), when recomputed
    holds: int  # leading prompt blocks the engine holds at least, lost batches included


def _lost_ranges(rep: WorkerReplay) -> list[tuple[int, int, str]]:
    """Batches the router never applied, as (first seq, last seq, how it was lost)."""
    out = [(a + 1, b - 1, f"the stream skips {_seq_span(a + 1, b - 1)}") for a, b in rep.seq.gaps]
    out += [(s, s, f"seq {s} could not be decoded and was dropped") for s in rep.malformed_seqs]
    if rep.seq.first is not None and rep.seq.first > 0:
        out.append((0, rep.seq.first - 1, f"the capture joined at seq {rep.seq.first}, after {_seq_span(0, rep.seq.first - 1)}"))
    return out


def _seq_span(lo: int, hi: int) -> str:
    return f"seq {lo}" if lo == hi else f"seq {lo}..{hi}"


def _gap_evidence(
    seen: _PromptPages, tokens: list[int], h_e: list[int], path_e: list[int], by_node: dict[int, PageSeen],
    i: int, rep: WorkerReplay, b: int, eagle: bool, salt: str | None,
) -> _Gap | str | None:
    """Did a lost batch store block ``i``? A :class:`_Gap` when stores after the loss prove or suggest it.

    Dynamo neither fences nor resyncs its index after a gap: an event whose parent was in the
    lost batch is dropped as an orphan, so the router is blind to everything under it. A lost
    batch counts only if it comes after the batch that stored block ``i - 1`` (block ``i`` needs
    its parent first) and no ``AllBlocksCleared`` separates it from the orphan. Returns a string
    (the lost batches, in words) when batches were lost there but no later store shows what
    they held, and None when nothing was lost.
    """
    floor = by_node[path_e[i - 1]].seq if 0 < i <= len(path_e) and path_e[i - 1] in by_node else None
    clears = [c for c in rep.cleared_at if c is not None]
    lost = [r for r in _lost_ranges(rep) if floor is None or r[1] > floor]

    def lost_before(seq: int | None) -> str:
        end = float("inf") if seq is None else seq
        hits = [words for lo, hi, words in lost if lo < end and not any(hi < c < end for c in clears)]
        return "; ".join(hits)

    # 1. An orphan's parent is SGLang's own hash of this prompt's block j >= i (recomputed from the
    #    prompt, and checked against the blocks the stream did deliver): the engine holds i..j.
    try:
        sg = [h & ((1 << 64) - 1) for h in engine_block_hashes(tokens, b, eagle=eagle, cache_salt=salt)]
    except ValueError:
        sg = []
    delivered = [by_node[n].ext for n in path_e[:i] if n in by_node]
    if len(sg) > i and sg[: len(delivered)] == delivered:
        where = {h: j for j, h in enumerate(sg) if j >= i}
        for o in seen.orphans:
            j = where.get(o.parent_ext)
            if j is None:
                continue
            lost_words = lost_before(o.seq) or "no sequence number is missing, so it was lost before publishing"
            blocks = f"block {i}" if j == i else f"blocks {i}..{j}"
            return _Gap("confirmed",
                        f"the engine stored {blocks} of this prompt in a batch the router never received "
                        f"({lost_words}): the event at seq {o.seq} stores {o.blocks} block(s) under parent "
                        f"{_signed(o.parent_ext)}, which is SGLang's own hash of this prompt's block {j} "
                        f"(recomputed from the prompt); Dynamo does not resync its index after a gap and drops "
                        f"that event as an orphan, so the router is cache-blind for this worker from block {i} on",
                        sg[i], _holds(h_e, b, seen, j + 1))
    # 2. A later block of this prompt (by its window) arrived under a parent the stream never delivered.
    later = set(h_e[i + 1 :])
    orphans = [p for p in seen.pages.values() if p.node is None and p.local in later]
    if orphans:
        p = min(orphans, key=lambda p: min(p.offsets))
        lost_words = lost_before(p.seq) or "no sequence number is missing, so it was lost before publishing"
        return _Gap("likely",
                    f"the engine most likely stored block {i} in a batch the router never received ({lost_words}): "
                    f"block {min(p.offsets) // b} of this prompt (SGLang hash {_signed(p.ext)}, seq {p.seq}) "
                    f"arrived under parent {_signed(p.parent_ext)}, which the stream never delivered, so Dynamo "
                    "drops it as an orphan (its window matches this prompt; its parent could not be tied to this "
                    "prompt by hash)", None, _holds(h_e, b, seen, min(p.offsets) // b + 1))
    # 3. Stores after the loss hang under parents never delivered, but none ties to this prompt.
    after = [o for o in seen.orphans if lost_before(o.seq)]
    if after:
        o = after[0]
        return _Gap("possible",
                    f"the engine may have stored block {i} in a batch the router never received "
                    f"({lost_before(o.seq)}): {len(after)} later event(s) (first at seq {o.seq}) hang under "
                    "parents the stream never delivered, so the lost batches stored blocks, but none of them can "
                    "be tied to this prompt", None, i)
    return lost_before(None) or None


def _holds(h_e: list[int], b: int, seen: _PromptPages, k: int) -> int:
    """Blocks 0..k-1 are held; extend through still-held orphan pages that continue this prompt."""
    held = {p.local: p for p in seen.pages.values() if p.node is None and p.removed_seq is None and p.cleared_seq is None}
    while k < len(h_e) and h_e[k] in held and k * b in held[h_e[k]].offsets:
        k += 1
    return k


def _shift_evidence(seen: _PromptPages, b: int) -> tuple[int, PageSeen] | None:
    """The dominant offset between engine page boundaries and the prompt's, when not zero.

    A page whose window also occurs at its aligned offset is aligned (a repetitive prompt puts
    the same window at several offsets), so only pages with no aligned occurrence count.
    """
    deltas: Counter[int] = Counter()
    first: dict[int, PageSeen] = {}
    for p in seen.pages.values():
        if p.depth is None:
            continue
        ks = {(p.depth - 1) * b - j for j in p.offsets}
        if 0 in ks:
            continue
        for k in ks:
            deltas[k] += 1
            if k not in first or p.depth < (first[k].depth or 0):
                first[k] = p
    if not deltas:
        return None
    k = deltas.most_common(1)[0][0]
    return k, first[k]


def _shifted_view(seen: _PromptPages, tokens: list[int], i: int, k: int, b: int, eagle: bool) -> BlockView:
    """The engine's block ``i`` on the shifted chain: prompt tokens moved by k, unknown ones as None."""
    start, end = i * b, i * b + b + (1 if eagle else 0)
    toks = [tokens[x - k] if 0 <= x - k < len(tokens) else None for x in range(start, end)]
    view = BlockView(i, start - k, end - k, toks, None)
    for p in seen.pages.values():
        if p.depth == i + 1 and (i * b - k) in p.offsets:
            view.hash, view.engine_block_hash, view.stored_seq, view.removed_seq = p.local, _signed(p.ext), p.seq, p.removed_seq
            return view
    if i == 0:
        for node, (ext, window, local, seq) in seen.roots.items():
            if all(t is None or bytes(window[4 * n : 4 * n + 4]) == int(t).to_bytes(4, "little") for n, t in enumerate(toks)):
                view.tokens = [int.from_bytes(window[n : n + 4], "little") for n in range(0, len(window), 4)]
                view.hash, view.engine_block_hash, view.stored_seq = local, _signed(ext), seq
                break
    return view


def _capture_notes(rep: WorkerReplay) -> list[str]:
    notes = list(rep.issues.describe(rep.path))
    if rep.seq.first and rep.seq.first not in rep.cleared_at[:1]:  # harmless when it starts with a full clear
        notes.append(f"the capture joined the stream at seq {rep.seq.first} (earlier batches were not seen)")
    if rep.seq.gaps:
        notes.append(f"{len(rep.seq.gaps)} sequence gaps, {rep.seq.missing_batches} batches missing ({rep.seq.describe_gaps()})")
    if rep.seq.restarts:
        notes.append(f"publisher restarted {len(rep.seq.restarts)} times (sequence reset)")
    if rep.malformed:
        notes.append(f"{sum(rep.malformed.values())} malformed batches skipped "
                     f"({', '.join(f'{k}: {n}' for k, n in rep.malformed.items())})")
    return notes


def _capture_stats(rep: WorkerReplay) -> dict[str, Any]:
    s = rep.stats
    return {"batches": rep.batches, "seq_first": rep.seq.first, "seq_last": rep.seq.last, "gaps": len(rep.seq.gaps),
            "missing_batches": rep.seq.missing_batches, "restarts": len(rep.seq.restarts),
            "malformed_skipped": sum(rep.malformed.values()), "blocks_stored": s.blocks_stored,
            "blocks_removed": s.blocks_removed, "held_blocks": rep.held, "orphan_events": s.dropped_orphans}

