"""The CPU worker's request handling, on SGLang's real radix cache (no runtime, no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from kvalign.model.events import AllBlocksCleared, BlockStored
from kvalign.live.engines import fake_cpu_worker as cpu_worker


def _engine(eagle: bool) -> cpu_worker.Engine:
    args = cpu_worker.parse_args(["--model-path", "/nonexistent", "--page-size", "4", "--token-delay-ms", "0",
                                  *(["--speculative-algorithm", "EAGLE3"] if eagle else [])])
    return cpu_worker.Engine(args)


async def _collect(handler: cpu_worker.Handler, request: dict) -> list[dict]:
    return [chunk async for chunk in handler.generate(request)]


@pytest.mark.parametrize("eagle", [True, False], ids=["eagle", "plain"])
def test_aggregated_streams_max_tokens_and_caches_committed_tokens(eagle):
    eng = _engine(eagle)
    assert eng.cache_eagle is eagle and eng.publisher is None
    prompt = list(range(10, 19))  # 9 tokens
    out = asyncio.run(_collect(cpu_worker.Handler(eng, "null", 0), {"token_ids": prompt, "stop_conditions": {"max_tokens": 4}}))
    assert [c["token_ids"] for c in out] == [[10], [11], [12], [13]]
    assert [c.get("finish_reason") for c in out] == [None, None, None, "length"]
    # committed = prompt + output[:-1] = 12 tokens: 3 plain pages, or 11 bigrams -> 2 EAGLE pages
    assert eng.cache.match(prompt + [10, 11, 12]) == (8 if eagle else 12)
    eng.shutdown()


def test_prefill_returns_bootstrap_params_and_caches_the_prompt():
    eng = _engine(True)
    h = cpu_worker.Handler(eng, "prefill", 4321)
    prompt = list(range(30, 39))
    given = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 1, "bootstrap_room": 77}
    (only,) = asyncio.run(_collect(h, {"request": {"token_ids": prompt, "bootstrap_info": given}}))
    assert only["token_ids"] == [] and only["disaggregated_params"] == given
    (own,) = asyncio.run(_collect(h, {"token_ids": list(range(50, 59))}))
    p = own["disaggregated_params"]
    assert (p["bootstrap_host"], p["bootstrap_port"]) == ("127.0.0.1", 4321) and isinstance(p["bootstrap_room"], int)
    assert eng.cache.match(prompt) == 8  # 8 bigrams = 2 pages of 4


def test_decode_requires_bootstrap_info_and_publishes_nothing():
    eng = _engine(True)
    h = cpu_worker.Handler(eng, "decode", 0)
    with pytest.raises(RuntimeError, match="bootstrap_info is required"):
        asyncio.run(_collect(h, {"token_ids": [1, 2, 3]}))
    out = asyncio.run(_collect(h, {"token_ids": list(range(9)), "bootstrap_info": {"bootstrap_room": 1},
                                   "stop_conditions": {"max_tokens": 2}}))
    assert len(out) == 2 and eng.cache.take_events() == []


def test_empty_prompt_is_rejected():
    with pytest.raises(ValueError, match="no token_ids"):
        asyncio.run(_collect(cpu_worker.Handler(_engine(False), "null", 0), {"token_ids": []}))


def test_cache_and_publish_drains_the_cache_events_it_publishes():
    eng = _engine(True)
    assert eng.cache_and_publish(list(range(100, 109))) == 0
    assert eng.cache.take_events() == []  # drained into the (absent) publisher, never left queued
    eng.cache.insert(list(range(200, 209)))
    (ev,) = eng.cache.take_events()
    assert isinstance(ev, BlockStored) and ev.block_size == 4 and len(ev.block_hashes) == 2
    assert ev.token_ids[0] == (200, 201)  # SGLang's EAGLE bigram keys


def test_clear_kv_blocks_flushes_with_sglang_s_all_blocks_cleared_and_refuses_while_a_request_runs():
    eng = _engine(True)
    h = cpu_worker.Handler(eng, "null", 0)
    prompt = list(range(10, 19))
    asyncio.run(_collect(h, {"token_ids": prompt, "stop_conditions": {"max_tokens": 4}}))
    assert eng.cache.match(prompt) > 0
    published: list = []
    eng._publish_pending = lambda: published.extend(eng.cache.take_events())  # what the publisher would send

    async def clear_while_streaming() -> tuple[list[dict], list[dict]]:
        stream = h.generate({"token_ids": prompt, "stop_conditions": {"max_tokens": 3}})
        await stream.__anext__()  # one request in flight
        refused = [c async for c in h.clear_kv_blocks({})]
        async for _ in stream:
            pass
        return refused, [c async for c in h.clear_kv_blocks({})]

    refused, cleared = asyncio.run(clear_while_streaming())
    assert refused == [{"status": "error", "message": "Cannot clear KV cache while requests are active"}]
    assert cleared == [{"status": "success", "message": "KV cache cleared"}]
    assert eng.cache.match(prompt) == 0
    assert [type(e) for e in published][-1] is AllBlocksCleared  # the flush's own event, published last
    eng.shutdown()
