"""kvalign.model.relay against Dynamo's real worker-side relay, end to end over loopback ZMQ.

The production path is: SGLang's ZmqEventPublisher -> Dynamo's Rust ZMQ decoder (bigram
detection per event, flattening, B+1 windows, namespace inheritance) -> the router's index. Here
SGLang's real publisher, fed by its real radix cache, publishes to Dynamo's runtime-free
``SelectionService``; its overlap answer must equal kvalign's prediction (kvalign's Relay +
PrefixIndex) and SGLang's own ``match_prefix``.
"""

from __future__ import annotations

import asyncio
import json
import time
from itertools import count

import pytest
from hypothesis import given, settings

from kvalign.model.hashing import block_hashes
from kvalign.model.index import PrefixIndex
from kvalign.live.cluster.ports import PortPool
from kvalign.oracles.sglang import to_kvalign_event
from kvalign.model.relay import Relay
from kvalign.verify.engine.strategies import PAGE_SIZES, scenarios

_sentinels = count(10**6, 97)
CARD_EAGLE_OFF = (True, 4, "card-eagle-off")


class DynamoRelayedWorkers:
    """For each (eagle, page size): an SGLang publisher and a Dynamo worker subscribed to it."""

    def __init__(self) -> None:
        from dynamo._core import SelectionService
        from sglang.srt.disaggregation.kv_events import EventPublisherFactory

        self.loop = asyncio.new_event_loop()

        async def make_service() -> SelectionService:  # its constructor needs a running loop
            return SelectionService(indexer_threads=1)

        self.service = self.run(make_service())
        self.publishers, self.workers = {}, {}
        keys = [(e, p) for e in (False, True) for p in PAGE_SIZES]
        keys.append(CARD_EAGLE_OFF)  # bigram events, but the model card says enable_eagle=False
        ports = PortPool()
        for n, key in enumerate(keys):
            port = ports.take(self.model(key))
            self.publishers[key] = EventPublisherFactory.create(json.dumps(
                {"publisher": "zmq", "topic": "kv-events", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True}), attn_dp_rank=0)
            self.workers[key] = 100 + n
            self.call("upsert_worker", {
                "worker_id": 100 + n, "model_name": self.model(key), "endpoint": "http://127.0.0.1:9",
                "kv_events_endpoint": f"tcp://127.0.0.1:{port}", "block_size": key[1], "is_eagle": key[0] and key != CARD_EAGLE_OFF})
        time.sleep(0.5)  # ZMQ slow joiner: subscriptions must reach the publishers first

    @staticmethod
    def model(key: tuple) -> str:
        return "-".join(["kvalign", "eagle" if key[0] else "plain", f"p{key[1]}", *key[2:]])

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def call(self, method: str, request: dict):
        """Await one service method; pyo3 futures need the loop running when they are created."""

        async def go():
            return await getattr(self.service, method)(request)

        return self.run(go())

    def publish(self, key, events) -> None:
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        self.publishers[key].publish(KVEventBatch(ts=time.time(), events=events))

    def overlap(self, key, tokens, lora, salt) -> int:
        request = {"token_ids": tokens, "model_name": self.model(key)}
        if lora:
            request["lora_name"] = lora
        if salt:
            request["cache_salt"] = salt
        answer = self.call("overlap_scores", request)
        return sum(w["device_blocks"] for w in answer["workers"] if w["worker_id"] == self.workers[key])

    def close(self) -> None:
        from kvalign.oracles.sglang import shutdown_publishers

        self.service.shutdown()
        shutdown_publishers(self.publishers.values())  # not SGLang's own atexit copy as well: 1 s each at exit
        self.loop.close()


@pytest.fixture(scope="module")
def dynamo_relay(sglang_available, router_hasher):
    workers = DynamoRelayedWorkers()
    yield workers
    workers.close()


def _settle(relay: DynamoRelayedWorkers, key, make_cache) -> None:
    """Publish a sentinel request from a fresh cache and wait until Dynamo has indexed it: ZMQ and
    the relay keep order, so everything published before it has been applied too."""
    p, eagle = key[1], key[0]
    tokens = [next(_sentinels) + i for i in range(2 * p + 1)]
    cache = make_cache(p, eagle)
    cache.insert(tokens)
    relay.publish(key, cache.take_raw_events())
    want = len(block_hashes(tokens, p, eagle=eagle))
    deadline = time.monotonic() + 5
    while relay.overlap(key, tokens, None, None) != want:
        assert time.monotonic() < deadline, "Dynamo never indexed the sentinel request within 5 s"
        time.sleep(0.02)


@settings(max_examples=max(10, settings.default.max_examples // 2))
@given(sc=scenarios(eagle=False, lora=True, namespace=True) | scenarios(eagle=True, lora=True, namespace=True))
def test_dynamo_relay_overlap_equals_kvalign_prediction_and_sglang(dynamo_relay, cache_factory, count_case, sc):
    from sglang.srt.disaggregation.kv_events import AllBlocksCleared

    count_case()
    make = cache_factory("unified")
    key = (sc.eagle, sc.page_size)
    cache = make(sc.page_size, sc.eagle)
    relay, index = Relay(sc.page_size), PrefixIndex()
    dynamo_relay.publish(key, [AllBlocksCleared()])
    for tokens, (lora, salt) in sc.inserts:
        cache.insert(tokens, lora_name=lora, cache_salt=salt)
        raw = cache.take_raw_events()
        dynamo_relay.publish(key, raw)
        for ev in map(to_kvalign_event, raw):
            converted = relay.convert(ev)
            if converted is not None:
                index.apply(1, converted)
    _settle(dynamo_relay, key, make)
    query, (lora, salt) = sc.query
    engine = cache.match(query, lora_name=lora, cache_salt=salt) // sc.page_size
    predicted = index.overlap(block_hashes(query, sc.page_size, eagle=sc.eagle, lora_name=lora, cache_namespace=salt)).get(1, 0)
    answered = dynamo_relay.overlap(key, query, lora, salt)
    assert engine == predicted == answered, f"SGLang {engine}, kvalign {predicted}, Dynamo relay {answered}"


def test_negative_control_card_without_eagle_is_cache_blind(dynamo_relay, cache_factory):
    """Dynamo #10982 / #11764: bigram events, but the router's model card has enable_eagle=False.
    The real relay indexes the B+1 windows, the query hashes B windows: overlap 0, silently —
    and kvalign names the cause."""
    from kvalign.model.causes import Cause, classify_hash_mismatch

    from sglang.srt.disaggregation.kv_events import AllBlocksCleared

    doc = list(range(100, 117))  # 17 tokens -> 16 bigrams -> 4 pages of 4
    cache = cache_factory("unified")(4, True)
    cache.insert(doc)
    events = cache.take_raw_events()
    assert cache.match(doc) // 4 == 4
    for key in (CARD_EAGLE_OFF, (True, 4)):  # same events to a correctly configured twin
        dynamo_relay.publish(key, [AllBlocksCleared(), *events])
    deadline = time.monotonic() + 5
    while dynamo_relay.overlap((True, 4), doc, None, None) != 4:
        assert time.monotonic() < deadline, "the correctly configured twin never indexed the events"
        time.sleep(0.02)
    time.sleep(0.2)
    assert dynamo_relay.overlap(CARD_EAGLE_OFF, doc, None, None) == 0
    router_query = block_hashes(doc, 4, eagle=False)
    assert classify_hash_mismatch(router_query, doc, 4, eagle=True) is Cause.ROUTER_EAGLE_OFF
