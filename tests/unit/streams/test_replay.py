"""Replay: the fused relay+index must equal the reference Relay+PrefixIndex and Dynamo's RadixTree.

``ReplayIndex`` re-implements the relay and index rules for speed, so it is held to the readable
reference on adversarial event streams (duplicate and re-used engine hashes, orphans, block-size
mismatches, namespace inheritance, removals, clears) and on streams from SGLang's real radix cache,
where the real Dynamo ``RadixTree`` is a third, independent opinion.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sglang_publisher import RECORDED, captured, raw_capture, sglang_publisher  # noqa: F401 - fixture

from kvalign.streams.capture import CaptureError, compact_event
from kvalign.cli import main
from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvalign.model.hashing import block_hashes
from kvalign.model.index import PrefixIndex
from kvalign.oracles.sglang import SglangRadixCache
from kvalign.model.relay import Relay
from kvalign.streams.replay import replay_captures
from kvalign.streams.replay_index import BatchRejected, ReplayIndex

KV_B = 2
SALTS = [None, "a"]


def reference(batches, kv_block_size=KV_B):
    """Relay + PrefixIndex, per worker, batch by batch."""
    relays: dict[int, Relay] = {}
    index = PrefixIndex()
    for worker, events in batches:
        relay = relays.setdefault(worker, Relay(kv_block_size))
        for ev in events:
            out = relay.convert(ev)
            if out is not None:
                index.apply(worker, out)
    return index, relays


def fused(batches, kv_block_size=KV_B, deferred=False):
    index = ReplayIndex(kv_block_size, deferred=deferred)
    for worker, events in batches:
        index.apply_batch(worker, [compact_event(e) for e in events])
    return index


@st.composite
def event_streams(draw):
    """Events cut from a few token documents, with deliberate damage mixed in."""
    docs = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=11), min_size=1, max_size=3))
    # tiny: re-used and colliding engine hashes happen often; the 2**40 offset gives distinct
    # hashes with equal low bits (the deferred index buckets hashes by their low bits)
    ext_pool = st.builds(int.__add__, st.integers(-3, 12), st.sampled_from([0, 1 << 40]))
    batches = []
    for _ in range(draw(st.integers(1, 12))):
        worker = draw(st.sampled_from([1, 2]))
        kind = draw(st.sampled_from(["stored"] * 6 + ["removed", "cleared"]))
        if kind == "removed":
            events = [BlockRemoved(draw(st.lists(ext_pool, max_size=3)))]
        elif kind == "cleared":
            events = [AllBlocksCleared()]
        else:
            doc = draw(st.sampled_from(docs))
            eagle = draw(st.booleans())
            bs = draw(st.sampled_from([KV_B, KV_B, KV_B, 1, 3]))
            pages = (max(len(doc) - 1, 0) if eagle else len(doc)) // bs
            if pages == 0:
                continue
            start = draw(st.integers(0, pages - 1))
            n = draw(st.integers(1, pages - start))
            units = [(doc[i], doc[i + 1]) for i in range(len(doc) - 1)] if eagle else list(doc)
            parent = None if start == 0 and draw(st.booleans()) else draw(ext_pool)
            events = [BlockStored(draw(st.lists(ext_pool, min_size=n, max_size=n)), parent,
                                  units[start * bs : (start + n) * bs], bs,
                                  cache_salt=draw(st.sampled_from(SALTS)), lora_name=draw(st.sampled_from([None, "L"])))]
        batches.append((worker, events))
    return docs, batches


def queries(docs):
    for doc in docs:
        for eagle in (False, True):
            for lora in (None, "L"):
                for ns in SALTS:
                    yield block_hashes(doc, KV_B, eagle=eagle, lora_name=lora, cache_namespace=ns)


@given(event_streams())
def test_fused_index_equals_relay_and_prefix_index(count_case, stream):
    count_case()
    docs, batches = stream
    ref, relays = reference(batches)
    got = fused(batches)
    for q in queries(docs):
        assert got.overlap(q) == ref.overlap(q), q
    for worker, relay in relays.items():
        s = got.stats(worker)
        assert (s.dropped_block_size, s.dropped_short_window, s.dropped_duplicate_events) == (
            relay.stats.dropped_block_size, relay.stats.dropped_short_window, relay.stats.dropped_duplicate_events)
        assert got.blocks(worker) == ref.blocks(worker)
    assert sum(got.stats(w).dropped_orphans for w in relays) == ref.dropped_orphans


@given(event_streams())
def test_deferred_index_equals_the_event_by_event_one(count_case, stream):
    """``replay`` defers applying events until a prompt is matched and computes stats and held
    blocks for the whole log at once; both must equal applying every event as it comes."""
    count_case()
    docs, batches = stream
    eager = fused(batches)
    got = fused(batches, deferred=True)
    for worker in {w for w, _ in batches}:
        assert asdict(got.stats(worker)) == asdict(eager.stats(worker))
        assert got.blocks(worker) == eager.blocks(worker)
    for q in queries(docs):  # matching applies the log event by event
        assert got.overlap(q) == eager.overlap(q), q
    for worker in {w for w, _ in batches}:
        assert asdict(got.stats(worker)) == asdict(eager.stats(worker))
        assert got.blocks(worker) == eager.blocks(worker)


def test_deferred_index_settles_orphans_in_event_order():
    """A parent whose last store was itself dropped (an orphan, or a page of another block size)
    is still mapped by an earlier store; an event with no pages, removals, a clear and a re-store
    after removal, each counted exactly as the event-by-event index counts them."""
    doc = list(range(10, 20))
    events = [
        [BlockStored([1, 2], None, doc[:4], KV_B)],
        [BlockStored([3], 99, doc[4:6], KV_B)],  # orphan: 99 never stored
        [BlockStored([2, 4], 3, doc[2:6], KV_B)],  # orphan too (3 was never indexed), re-stores 2
        [BlockStored([5], 2, doc[4:6], KV_B)],  # 2 is still mapped by the first event
        [BlockStored([], 5, [], KV_B)],  # no pages
        [BlockStored([6], 5, doc[6:8], KV_B)],
        [BlockStored([7], 6, doc[8:9], 1)],  # another block size: 7 not indexed
        [BlockStored([8], 7, doc[8:10], KV_B)],  # orphan: 7 was dropped
        [BlockRemoved([5]), BlockStored([9], 5, doc[6:8], KV_B)],  # orphan: 5 removed first
        [BlockStored([5], 2, doc[4:6], KV_B), BlockStored([9], 5, doc[6:8], KV_B)],  # re-stored: fine
        [AllBlocksCleared(), BlockStored([10], 1, doc[2:4], KV_B)],  # orphan: cleared
        [BlockStored([11], None, doc[:2], KV_B)],
    ]
    batches = [(1, evs) for evs in events]
    eager, got = fused(batches), fused(batches, deferred=True)
    assert asdict(got.stats(1)) == asdict(eager.stats(1))
    assert got.stats(1).dropped_orphans == 5 and got.stats(1).dropped_block_size == 1
    assert got.blocks(1) == eager.blocks(1) == 1
    ref, _ = reference(batches)
    assert got.overlap(block_hashes(doc, KV_B)) == ref.overlap(block_hashes(doc, KV_B)) == {1: 1}


def test_deferred_index_keeps_applying_after_a_match():
    """A match applies the log; batches after it are applied as they come, with the same result."""
    doc = list(range(10, 20))
    first = [(1, [BlockStored([1, 2], None, doc[:4], KV_B)]), (2, [BlockStored([7], None, doc[:2], KV_B)])]
    later = [(1, [BlockStored([3], 2, doc[4:6], KV_B), BlockRemoved([1])]), (2, [BlockStored([8], 7, doc[2:4], KV_B)])]
    got = fused(first, deferred=True)
    q = block_hashes(doc, KV_B)
    assert got.overlap(q) == fused(first).overlap(q) == {1: 2, 2: 1}
    for worker, events in later:
        got.apply_batch(worker, [compact_event(e) for e in events])
    eager = fused(first + later)
    assert got.overlap(q) == eager.overlap(q) == {2: 2}
    for worker in (1, 2):
        assert (got.blocks(worker), asdict(got.stats(worker))) == (eager.blocks(worker), asdict(eager.stats(worker)))


ops = st.lists(st.one_of(
    st.tuples(st.just("insert"), st.lists(st.integers(0, 4), min_size=1, max_size=20), st.sampled_from([None, "t1"])),
    st.tuples(st.just("evict"), st.integers(1, 12), st.none()),
), min_size=1, max_size=10)


@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
@given(seq_ops=ops)
def test_real_cache_streams_agree_with_reference_and_dynamo(count_case, cache_factory, dynamo_tree, eagle, seq_ops):
    count_case()
    cache = cache_factory("unified")(KV_B, eagle)
    batches, inserted = [], []
    for op, arg, salt in seq_ops:
        if op == "insert":
            cache.insert(arg, cache_salt=salt)
            inserted.append((arg, salt))
        else:
            cache.evict(arg)
        batches.append((1, cache.take_events()))
    ref, _ = reference(batches)
    got = fused(batches)
    deferred = fused(batches, deferred=True)
    assert (deferred.blocks(1), asdict(deferred.stats(1))) == (got.blocks(1), asdict(got.stats(1)))
    tree = dynamo_tree()
    relay = Relay(KV_B)
    for _, events in batches:
        for ev in events:
            out = relay.convert(ev)
            if out is not None:
                tree.apply(1, out)
    for tokens, salt in inserted:
        q = block_hashes(tokens, KV_B, eagle=eagle, cache_namespace=salt)
        assert got.overlap(q) == ref.overlap(q) == tree.overlap(q) == deferred.overlap(q)
        assert got.overlap(q).get(1, 0) * KV_B == cache.match(tokens, cache_salt=salt)  # and the engine itself


def test_batch_with_out_of_range_token_is_dropped_whole():
    ok = BlockStored([1], None, [1, 2], KV_B)
    wide = BlockStored([2], None, [5, 2**32], KV_B)
    index = ReplayIndex(KV_B)
    with pytest.raises(BatchRejected, match="u32"):
        index.apply_batch(1, [compact_event(ok), compact_event(wide)])
    assert index.blocks(1) == 0  # nothing of the batch was applied


def test_replay_cli_reports_workers_gaps_and_malformed(tmp_path, sglang_publisher, capsys):
    cache = SglangRadixCache(4, eagle=True)
    with captured(tmp_path, sglang_publisher, name="a.jsonl", lossy=True) as a:
        for end, drop in ((9, False), (13, True), (21, False)):
            cache.insert(list(range(100, 100 + end)))
            a.publish(cache.take_raw_events(), drop=drop)
        cache.evict(100)
        a.publish(cache.take_raw_events())
    good = bytes.fromhex(RECORDED[("0.5.23", True)])
    unknown = good.replace(b"BlockRemoved", b"BlockMissing")
    b = raw_capture(tmp_path, [good, good[:-9], unknown, good], name="b.jsonl")

    assert main(["replay", a.path, b, "--worker", "prefill", "--worker", "decode", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    w_a, w_b = out["workers"]
    assert (w_a["worker"], w_b["worker"]) == ("prefill", "decode") and out["kv_block_size"] == 4
    assert w_a["gaps"] == [{"after": w_a["gaps"][0]["after"], "next": w_a["gaps"][0]["after"] + 2, "missing": 1}]
    assert w_a["blocks_stored"] == 4 and w_a["dropped_orphans"] == 1  # page 2 was lost on the way
    assert w_a["blocks_removed"] == 5 and w_a["held_blocks"] == 0
    assert w_b["malformed_skipped"] == {"payload is not valid msgpack": 1, "unknown event type 'BlockMissing'": 1}
    assert w_b["blocks_stored"] == 2 * (w_b["batches"] - 2) and w_b["held_blocks"] == 0

    assert main(["replay", b]) == 0
    text = capsys.readouterr().out
    assert "malformed batches skipped: 2" in text and "blocks/s" in text
    with pytest.raises(CaptureError, match="is malformed: payload is not valid msgpack"):
        replay_captures([b], strict=True)


def test_replay_with_a_router_block_size_the_engine_does_not_use(tmp_path, sglang_publisher):
    cache = SglangRadixCache(4, eagle=False)
    with captured(tmp_path, sglang_publisher) as stream:
        cache.insert(list(range(16)))
        stream.publish(cache.take_raw_events())
    index, (rep,) = replay_captures([stream.path], block_size=8)
    assert rep.stats.blocks_stored == 4 and rep.stats.dropped_block_size == 4 and rep.held == 0
    index, (rep,) = replay_captures([stream.path])
    assert index.kv_block_size == 4 and rep.held == 4


def test_negative_control_misaligned_router_query_disagrees_with_the_engine(cache_factory):
    """The agreement above is not vacuous: a router that ignores is_eagle, querying the same
    replayed index, no longer reproduces SGLang's reuse."""
    from kvalign.verify.misaligned import ignore_eagle

    cache = cache_factory("unified")(KV_B, True)
    doc = list(range(1, 12))
    cache.insert(doc)
    got = fused([(1, cache.take_events())])
    engine = cache.match(doc)
    assert engine == 10 and got.overlap(block_hashes(doc, KV_B, eagle=True)).get(1, 0) * KV_B == engine
    assert got.overlap(ignore_eagle(doc, KV_B, None, None, True, None)).get(1, 0) * KV_B != engine
