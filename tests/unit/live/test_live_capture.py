"""Live capture: SGLang's real cache + real ZmqEventPublisher -> EventCapture -> kvalign index,
checked against Dynamo's real hasher (the broker's relay: test_live_wire_proxy.py)."""

from __future__ import annotations

import time

import pytest
import zmq

from kvalign.model.hashing import block_hashes
from kvalign.live.wire.capture import EventCapture
from kvalign.live.cluster.ports import PortPool
from kvalign.model.index import router_kv_hit_rate
from kvalign.oracles.sglang import shutdown_publisher


@pytest.fixture
def sglang_publisher():
    from kvalign.oracles.sglang import _modules

    _modules()
    from sglang.srt.disaggregation.kv_events import EventPublisherFactory, KVEventBatch

    port = PortPool().take("kv")
    endpoint = f"tcp://127.0.0.1:{port}"
    pub = EventPublisherFactory.create(f'{{"publisher":"zmq","endpoint":"{endpoint}","bind":true}}', 0)
    yield endpoint, pub, KVEventBatch
    shutdown_publisher(pub)


@pytest.mark.parametrize("eagle", [True, False], ids=["eagle", "plain"])
def test_captured_sglang_events_predict_the_router_overlap(sglang_publisher, eagle):
    from kvalign.oracles.dynamo import load_router_hasher
    from kvalign.oracles.sglang import SglangRadixCache

    endpoint, pub, batch_cls = sglang_publisher
    b, worker = 4, 7
    cache = SglangRadixCache(b, eagle=eagle)
    doc = list(range(100, 100 + 5 * b + 1))
    with EventCapture({"w": endpoint}) as cap:
        time.sleep(0.3)  # PUB/SUB slow joiner
        cache.insert(doc)
        pub.publish(batch_cls(ts=time.time(), events=cache.take_raw_events()))
        assert cap.wait_for(lambda snap: len(snap) >= 1, 5.0), "no batch captured"
        assert not cap.errors
        units = cap.stored_token_units("w")
        assert units and all(isinstance(u, (list, tuple)) == eagle for u in units[0])
        idx = cap.index({"w": worker}, b, load_router_hasher())
    real = load_router_hasher()
    prompt = doc[: 3 * b + 1] + [9] * 6
    query = [int(h) for h in real(prompt, b, None, None, eagle, None)]
    assert query == block_hashes(prompt, b, eagle=eagle)
    assert idx.overlap(query) == {worker: 3}
    assert idx.overlap([int(h) for h in real(prompt, b, None, None, not eagle, None)]) == {}  # flag mismatch: blind
    assert router_kv_hit_rate(3, len(prompt), b) == 3 / 5


def test_malformed_frames_are_recorded_not_fatal():
    port = PortPool().take("kv")
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    try:
        with EventCapture({"w": f"tcp://127.0.0.1:{port}"}) as cap:
            time.sleep(0.3)
            pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1not msgpack"])
            assert cap.wait_for(lambda _: bool(cap.errors), 5.0)
            assert cap.errors[0][0] == "w" and "msgpack" in cap.errors[0][1] and cap.count() == 0
    finally:
        pub.close()
