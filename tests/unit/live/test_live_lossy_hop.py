"""The fuzz's lossy hop (kvalign/live/wire/lossy_hop.py) between SGLang's real KV-event publisher and a
subscriber, on loopback: it forwards every batch byte for byte, and once armed swallows exactly
the next batch of the kind asked for (all stores, or all removals/clears), never a mixed one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from kvalign.model.events import decode_frames
from kvalign.live.wire.lossy_hop import LossyHop

pytestmark = pytest.mark.slow  # SGLang's real publisher: the first import of SGLang costs about a minute
from sglang_publisher import RealPublisher, free_port


def _collect(sub: zmq.Socket, n: int, timeout_s: float = 10.0) -> list[list[bytes]]:
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        if sub.poll(50):
            out.append(sub.recv_multipart())
    return out


@contextmanager
def hop_stream() -> Iterator[tuple[RealPublisher, LossyHop, zmq.Socket]]:
    """SGLang's publisher -> the hop -> a subscriber, warmed up past ZMQ's slow joiner."""
    pub = RealPublisher()
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with LossyHop({"w": pub.endpoint}, {"w": free_port()}) as hop:
            sub.connect(hop.downstream["w"])
            deadline = time.monotonic() + 10
            while not sub.poll(50):
                assert time.monotonic() < deadline, "no batch crossed the hop"
                pub.publish([pub.kv.AllBlocksCleared()])
            while sub.poll(200):
                sub.recv_multipart()
            yield pub, hop, sub
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.close()


def _stored(kv: object) -> object:
    return kv.BlockStored(block_hashes=[11], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4,  # type: ignore[attr-defined]
                          lora_id=None, medium="GPU")


def test_hop_forwards_and_drops_only_the_next_store_batch() -> None:
    with hop_stream() as (pub, hop, sub):
        hop.drop_next_store_batch()
        seq_removed = pub.publish([pub.kv.BlockRemoved(block_hashes=[9], medium="GPU")])  # passes: not a store
        seq_mixed = pub.publish([_stored(pub.kv), pub.kv.BlockRemoved(block_hashes=[9], medium="GPU")])  # passes: mixed
        seq_lost = pub.publish([_stored(pub.kv)])
        seq_kept = pub.publish([_stored(pub.kv)])
        assert [decode_frames(f).seq for f in _collect(sub, 3)] == [seq_removed, seq_mixed, seq_kept]
        assert [(d.label, d.seq, d.blocks, d.kind) for d in hop.dropped] == [("w", seq_lost, 1, "store")]
        assert not hop.disarm()


def test_hop_armed_for_a_removal_loses_only_a_removal_batch_of_that_worker() -> None:
    with hop_stream() as (pub, hop, sub):
        hop.drop_next_removal_batch("other")  # another worker's removal: this stream loses nothing
        seq_a = pub.publish([pub.kv.BlockRemoved(block_hashes=[9], medium="GPU")])
        assert [decode_frames(f).seq for f in _collect(sub, 1)] == [seq_a] and hop.dropped == []
        hop.drop_next_removal_batch("w")
        seq_store = pub.publish([_stored(pub.kv)])
        seq_mixed = pub.publish([_stored(pub.kv), pub.kv.BlockRemoved(block_hashes=[9], medium="GPU")])
        seq_lost = pub.publish([pub.kv.BlockRemoved(block_hashes=[11], medium="GPU")])
        seq_clear = pub.publish([pub.kv.AllBlocksCleared()])
        assert [decode_frames(f).seq for f in _collect(sub, 3)] == [seq_store, seq_mixed, seq_clear]
        assert [(d.seq, d.blocks, d.kind) for d in hop.dropped] == [(seq_lost, 1, "removal")]


def test_negative_control_an_unarmed_hop_loses_nothing() -> None:
    with hop_stream() as (pub, hop, sub):
        seqs = [pub.publish([_stored(pub.kv)]) for _ in range(3)]
        assert [decode_frames(f).seq for f in _collect(sub, 3)] == seqs and hop.dropped == []


def test_strip_salt_hop_delivers_stored_blocks_without_their_tenant() -> None:
    """The tenant negative control's hop: SGLang's own tagged-map batch, re-encoded without
    ``cache_salt``; everything else in the event is kept."""
    with hop_stream() as (pub, hop, sub):
        hop.strip_salt = True
        salted = pub.kv.BlockStored(block_hashes=[11], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=4,
                                    lora_id=None, medium="GPU", cache_salt="tenant-a")
        seq = pub.publish([salted])
        (frames,) = _collect(sub, 1)
        batch = decode_frames(frames)
        (ev,) = batch.events
        assert batch.seq == seq and ev.cache_salt is None and ev.block_hashes == [11] and ev.token_ids == [1, 2, 3, 4]
        assert hop.stripped == 1
        hop.strip_salt = False  # negative control: the same event keeps its tenant
        pub.publish([salted])
        (frames,) = _collect(sub, 1)
        assert decode_frames(frames).events[0].cache_salt == "tenant-a"


def test_the_tap_sees_every_batch_but_one_lost_unpublished() -> None:
    """kvalign's engine view reads the tap: a batch the hop loses for the router is still the
    engine's; one lost *unpublished* is lost to every subscriber."""
    pub = RealPublisher()
    ctx = zmq.Context()
    sub, tap = ctx.socket(zmq.SUB), ctx.socket(zmq.SUB)
    for s in (sub, tap):
        s.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        with LossyHop({"w": pub.endpoint}, {"w": free_port()}, taps={"w": free_port()}) as hop:
            sub.connect(hop.downstream["w"])
            tap.connect(hop.taps["w"])
            deadline = time.monotonic() + 10
            while not (sub.poll(50) and tap.poll(50)):
                assert time.monotonic() < deadline, "no batch crossed the hop"
                pub.publish([pub.kv.AllBlocksCleared()])
            for s in (sub, tap):
                while s.poll(200):
                    s.recv_multipart()
            hop.drop_next_store_batch()
            seq_router_lost = pub.publish([_stored(pub.kv)])
            while not hop.dropped:  # the hop took the first arm before it is armed again
                assert time.monotonic() < deadline + 10, "the hop never dropped the armed batch"
                time.sleep(0.01)
            hop.drop_next_store_batch(unpublished=True)
            seq_unpublished = pub.publish([_stored(pub.kv)])
            seq_kept = pub.publish([_stored(pub.kv)])
            assert [decode_frames(f).seq for f in _collect(tap, 2)] == [seq_router_lost, seq_kept]
            assert [decode_frames(f).seq for f in _collect(sub, 1)] == [seq_kept]
            assert [(d.seq, d.unpublished) for d in hop.dropped] == [(seq_router_lost, False), (seq_unpublished, True)]
    finally:
        sub.close(linger=0)
        tap.close(linger=0)
        ctx.term()
        pub.close()
