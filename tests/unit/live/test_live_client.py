"""SSE / nvext parsing of the Dynamo frontend's streamed chat completions (pure, no server)."""

from __future__ import annotations

import json

import pytest

from kvalign.live.wire.client import SseError, chat_payload, parse_sse


def _data(obj) -> str:
    return "data: " + json.dumps(obj)


def _chunk(content=None, finish=None, nvext=None, usage=None):
    c = {"choices": [{"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}]}
    if nvext is not None:
        c["nvext"] = nvext
    if usage is not None:
        c["usage"] = usage
    return _data(c)


# A stream shaped like the live 1.6.1 frontend's (worker ids on every chunk, timing on the last).
WID = {"worker_id": {"prefill_worker_id": 11, "prefill_dp_rank": 0, "decode_worker_id": 22, "decode_dp_rank": 0}}
TIMING = {"request_received_ms": 1, "prefill_wait_time_ms": 0.5, "prefill_time_ms": 2.0, "ttft_ms": 2.5,
          "total_time_ms": 9.0, "kv_hit_rate": 0.3333333333333333, "router_queue_depth": 0,
          "kv_transfer_estimated_latency_ms": 0.4}
STREAM = [
    _chunk(nvext=WID), "", _chunk(" the", nvext=WID), "", _chunk(" fox", "length", nvext={**WID, "timing": TIMING}), "",
    _data({"choices": [], "usage": {"prompt_tokens": 39, "completion_tokens": 2, "total_tokens": 41}}), "", "data: [DONE]", "",
]


def test_parses_worker_ids_timing_usage_and_text():
    r = parse_sse(STREAM)
    assert (r.prefill_worker_id, r.decode_worker_id, r.prefill_dp_rank, r.decode_dp_rank) == (11, 22, 0, 0)
    assert r.kv_hit_rate == pytest.approx(1 / 3)
    assert r.timing["kv_transfer_estimated_latency_ms"] == 0.4
    assert r.text == " the fox" and r.finish_reason == "length"
    assert r.prompt_tokens == 39 and r.done and r.chunks == 4


def test_bytes_lines_and_comments_are_accepted():
    r = parse_sse([b": keep-alive", *(s.encode() for s in STREAM)])
    assert r.prefill_worker_id == 11 and r.done


def test_missing_nvext_leaves_fields_empty():
    r = parse_sse([_chunk(" a", "stop"), "data: [DONE]"])
    assert r.prefill_worker_id is None and r.kv_hit_rate is None and r.timing == {}


@pytest.mark.parametrize("lines, msg", [
    (["data: {not json"], "not JSON"),
    (["garbage line"], "unexpected SSE line"),
    (["data: [1, 2]"], "not an object"),
    (["data: [DONE]", _chunk(" late")], "after \\[DONE\\]"),
    ([_data({"error": {"message": "boom"}})], "server error"),
    ([_chunk(nvext={"worker_id": {"prefill_worker_id": "x"}})], "not an integer"),
    ([_chunk(nvext={"worker_id": {"prefill_worker_id": 1}}), _chunk(nvext={"worker_id": {"prefill_worker_id": 2}})], "changed"),
    ([_chunk(nvext={"worker_id": [1]})], "not an object"),
])
def test_malformed_streams_raise_one_clear_error(lines, msg):
    with pytest.raises(SseError, match=msg):
        parse_sse(lines)


def test_payload_requests_worker_id_timing_and_usage():
    p = chat_payload("m", "hi", max_tokens=3)
    assert p["nvext"]["extra_fields"] == ["worker_id", "timing"]
    assert p["stream"] is True and p["stream_options"] == {"include_usage": True} and p["max_tokens"] == 3


# A /v1/completions body from dynamo.frontend 1.6.1 + a real sglang-cpu worker (EAGLE3, page 16),
# recorded on this machine: the same 40-token prompt's second request.
LIVE_COMPLETION = {
    "id": "cmpl-931cd57c", "choices": [{"text": " ok ok ok ok", "index": 0, "finish_reason": "length"}],
    "object": "text_completion",
    "usage": {"prompt_tokens": 40, "completion_tokens": 5, "total_tokens": 45,
              "prompt_tokens_details": {"audio_tokens": None, "cached_tokens": 32}},
    "nvext": {"worker_id": {"prefill_worker_id": 6469806450445467676, "prefill_dp_rank": 0,
                            "decode_worker_id": 6469806450445467676, "decode_dp_rank": 0},
              "completion_token_ids": [4, 0, 0, 0, 0],
              "timing": {"ttft_ms": 70.5, "total_time_ms": 409.9, "kv_hit_rate": 0.6666666666666666}},
}


def test_completion_body_gives_router_engine_and_output_views():
    from kvalign.live.wire.client import parse_completion

    c = parse_completion(LIVE_COMPLETION)
    assert (c.prompt_tokens, c.cached_tokens, c.completion_token_ids) == (40, 32, [4, 0, 0, 0, 0])
    assert c.prefill_worker_id == c.decode_worker_id == 6469806450445467676 and c.kv_hit_rate == pytest.approx(2 / 3)


@pytest.mark.parametrize("body, msg", [
    ([], "not an object"), ({"error": {"message": "x"}}, "server error"), ({"usage": {}}, "no usage.prompt_tokens"),
    ({"usage": {"prompt_tokens": 3}, "nvext": {"completion_token_ids": ["a"]}}, "not a list of integers"),
    ({"usage": {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": "1"}}}, "cached_tokens is not an integer"),
])
def test_malformed_completion_bodies_raise_one_clear_error(body, msg):
    from kvalign.live.wire.client import SseError, parse_completion

    with pytest.raises(SseError, match=msg):
        parse_completion(body)


def test_each_chunks_completion_token_ids_are_concatenated_in_order():
    """The frontend sends each chunk's own output ids (SGLang's speculative decode streams several per
    chunk); the answer's ids are their concatenation, and a stream without them says None, not []."""
    chunks = [{"choices": [{"delta": {"content": "a b"}}], "nvext": {"completion_token_ids": [28, 24]}},
              {"choices": [{"delta": {"content": " c"}, "finish_reason": "length"}],
               "nvext": {"completion_token_ids": [27]}}]
    res = parse_sse([f"data: {json.dumps(c)}" for c in chunks] + ["data: [DONE]"])
    assert res.token_ids == [28, 24, 27]
    assert parse_sse(["data: {\"choices\": []}", "data: [DONE]"]).token_ids is None
    with pytest.raises(SseError, match="completion_token_ids is not a list of integers"):
        parse_sse(['data: {"nvext": {"completion_token_ids": [1, "x"]}}'])
    payload = chat_payload("m", "hi", max_tokens=4, extra_fields=("worker_id", "timing", "completion_token_ids"))
    assert payload["nvext"]["extra_fields"] == ["worker_id", "timing", "completion_token_ids"]
