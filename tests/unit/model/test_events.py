"""kvalign.model.events: SGLang's ZMQ KV-event wire format, both encodings.

Byte-exact payloads were recorded from the real SGLang publishers (0.5.19 positional, 0.5.23 map;
shared/docs/reference/sglang-radix-keys.md §5). The installed SGLang's own ZmqEventPublisher is
also driven over loopback with events from its real radix cache.
"""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored, EventDecodeError, decode_frames, decode_payload
from kvalign.live.cluster.ports import PortPool
from kvalign.oracles.sglang import shutdown_publisher
from kvalign.verify.engine.strategies import PAGE_SIZES, token_ids

# Recorded from sglang 0.5.19 (positional) and 0.5.23 (map): P=4, insert 1..10, evict(4).
RECORDED = {
    ("0.5.19", False): "93cb41d954fc400000009391b0416c6c426c6f636b73436c656172656497ab426c6f636b53746f72656492d3cf97adeedb59e05bcf4ebfa8a1f3c34151c098010203040506070804c0a347505593ac426c6f636b52656d6f76656492d3cf97adeedb59e05bcf4ebfa8a1f3c34151a347505500",
    ("0.5.19", True): "93cb41d954fc400000009391b0416c6c426c6f636b73436c656172656497ab426c6f636b53746f72656492d3f721fe42aac11dcbd3c35ad698917936a4c09892010292020392030492040592050692060792070892080904c0a347505593ac426c6f636b52656d6f76656492d3f721fe42aac11dcbd3c35ad698917936a4a347505500",
    ("0.5.23", False): "93cb41d954fc400000009381a474797065b0416c6c426c6f636b73436c656172656487a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392d3cf97adeedb59e05bcf4ebfa8a1f3c34151b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347505583a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392d3cf97adeedb59e05bcf4ebfa8a1f3c34151a66d656469756da347505500",
    ("0.5.23", True): "93cb41d954fc400000009381a474797065b0416c6c426c6f636b73436c656172656487a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392d3f721fe42aac11dcbd3c35ad698917936a4b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f69647398920102920203920304920405920506920607920708920809aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da347505583a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657392d3f721fe42aac11dcbd3c35ad698917936a4a66d656469756da347505500",
}
PLAIN_HASHES = [-3488128144981237669, 5674439469042975057]
EAGLE_HASHES = [-638950109823820341, -4369944537645631836]


@pytest.mark.parametrize(("version", "eagle"), list(RECORDED), ids=[f"{v}-{'eagle' if e else 'plain'}" for v, e in RECORDED])
def test_decodes_recorded_payloads(version, eagle):
    batch = decode_payload(bytes.fromhex(RECORDED[(version, eagle)]))
    assert batch.encoding == ("positional" if version == "0.5.19" else "map")
    assert batch.ts == 1700000000.0 and batch.dp_rank == 0
    cleared, stored, removed = batch.events
    assert cleared == AllBlocksCleared()
    hashes = EAGLE_HASHES if eagle else PLAIN_HASHES
    tokens = [[i, i + 1] for i in range(1, 9)] if eagle else list(range(1, 9))
    assert stored == BlockStored(hashes, None, tokens, 4, None, "GPU")
    assert removed == BlockRemoved(hashes, "GPU")


def test_positional_metadata_map_carries_cache_salt():
    ev = ["BlockStored", [5], None, [1, 2], 2, None, "GPU", {"cache_salt": "s1"}]
    (stored,) = decode_payload(msgpack.packb([1.0, [ev], 0])).events
    assert stored.cache_salt == "s1"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (bytes.fromhex(RECORDED[("0.5.23", True)])[:-9], "not valid msgpack"),
        (b"", "not valid msgpack"),
        (msgpack.packb({"ts": 1}), "not a [ts, events, dp_rank] batch"),
        (msgpack.packb([1.0, [["Bogus"]], 0]), "unknown event type 'Bogus'"),
        (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2, 3],
                               "block_size": 2, "lora_id": None, "medium": "GPU"}], 0]), "3 token units for 1 blocks of size 2"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [[1, 2, 3]], 1, None, "GPU"]], 0]), "not an int or an int pair"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [[1, 2], 3], 2, None, "GPU"]], 0]), "mixes ints and int pairs"),
        (msgpack.packb([1.0, [["BlockStored", [1], None, [1], 0, None, "GPU"]], 0]), "block_size must be a positive integer"),
        (msgpack.packb([1.0, [["AllBlocksCleared"], {"type": "AllBlocksCleared"}], 0]), "mixes positional and map"),
        (msgpack.packb(["x", [], 0]), "timestamp is not a number"),
    ],
)
def test_malformed_payloads_raise_one_clear_error(payload, message):
    with pytest.raises(EventDecodeError, match=None) as err:
        decode_payload(payload)
    assert message in str(err.value)


def test_frame_checks_topic_and_sequence_width():
    payload = bytes.fromhex(RECORDED[("0.5.23", False)])
    assert decode_frames([b"kv-events", (7).to_bytes(8, "big"), payload], expected_topic=b"kv-events").seq == 7
    with pytest.raises(EventDecodeError, match="topic b'other' is not the expected b'kv-events'"):
        decode_frames([b"other", (7).to_bytes(8, "big"), payload], expected_topic=b"kv-events")
    with pytest.raises(EventDecodeError, match="sequence frame has 3 bytes"):
        decode_frames([b"kv-events", b"\0\0\7", payload])
    with pytest.raises(EventDecodeError, match="expected 3 frames"):
        decode_frames([payload])


@pytest.fixture(scope="module")
def sglang_publisher(sglang_available):
    """SGLang's real ZmqEventPublisher on a loopback port, with a SUB socket connected to it."""
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory

    ctx = zmq.Context.instance()
    port = PortPool().take("sglang-kv-events")
    publisher = EventPublisherFactory.create(
        f'{{"publisher": "zmq", "topic": "kv-events", "endpoint": "tcp://127.0.0.1:{port}", "bind": true}}', attn_dp_rank=0)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)  # ZMQ slow joiner: let the subscription reach the publisher
    yield publisher, sub
    sub.close(linger=0)
    shutdown_publisher(publisher)


@settings(max_examples=max(20, settings.default.max_examples // 2))
@given(inserts=st.lists(token_ids(max_size=30, vocab=3), min_size=1, max_size=4), page_size=st.sampled_from(PAGE_SIZES),
       eagle=st.booleans(), salt=st.sampled_from([None, "tenant-1"]), evict=st.booleans())
def test_real_sglang_publisher_round_trips_through_decoder(sglang_publisher, count_case, inserts, page_size, eagle, salt, evict):
    from sglang.srt.disaggregation.kv_events import KVEventBatch

    from kvalign.oracles.sglang import SglangRadixCache, to_kvalign_event

    count_case()
    publisher, sub = sglang_publisher
    cache = SglangRadixCache(page_size, eagle=eagle)
    for tokens in inserts:
        cache.insert(tokens, cache_salt=salt)
    if evict:
        cache.evict(10**6)
    raw = cache.take_raw_events()
    if not raw:
        return
    publisher.publish(KVEventBatch(ts=time.time(), events=raw))
    batch = decode_frames(sub.recv_multipart(), expected_topic=b"kv-events")
    assert batch.encoding == "map"  # sglang >= 0.5.23 sends tagged maps
    assert batch.dp_rank == 0
    assert [_normalize(e) for e in batch.events] == [_normalize(to_kvalign_event(e)) for e in raw]


def _normalize(ev):
    """Wire pairs arrive as lists; the in-process events hold tuples."""
    if isinstance(ev, BlockStored):
        return BlockStored(ev.block_hashes, ev.parent_block_hash, [list(t) if isinstance(t, (list, tuple)) else t for t in ev.token_ids],
                           ev.block_size, ev.lora_id, ev.medium, ev.cache_salt, ev.lora_name, ev.session_id)
    return ev
