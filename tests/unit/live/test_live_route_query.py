"""The query-only routing request and its answer (shapes seen from the live 1.6.1 frontend)."""

from __future__ import annotations

import pytest

from kvalign.live.wire.client import SseError
from kvalign.live.wire.route_query import QUERY_ONLY, RouteAnswer, parse_route_answer, query_payload

#: A live answer (dynamo.frontend 1.6.1, /v1/completions with nvext.annotations ["query_instance_id:"]).
LIVE_ANSWER = {"id": "cmpl-1", "choices": [{"text": "", "index": 0}], "object": "text_completion", "usage": None,
               "nvext": {"worker_id": {"prefill_worker_id": 188774707019889728, "prefill_dp_rank": 0,
                                       "decode_worker_id": 188774707019889728, "decode_dp_rank": 0},
                         "token_ids": [3, 4, 5]}}


def test_payload_is_query_only_with_the_colon():
    p = query_payload("m", [3, 4, 5], cache_salt="t1")
    assert QUERY_ONLY == "query_instance_id:" and p["nvext"] == {"annotations": ["query_instance_id:"], "cache_salt": "t1"}
    assert p["prompt"] == [3, 4, 5] and p["stream"] is False
    assert "cache_salt" not in query_payload("m", [1])["nvext"]


def test_the_live_answer_names_the_worker():
    assert parse_route_answer(LIVE_ANSWER) == RouteAnswer(188774707019889728, 188774707019889728)


@pytest.mark.parametrize("body", [
    {"choices": [{"text": " fox"}]},  # a dispatched request (the annotation without its colon is ignored)
    {"nvext": {"worker_id": {"decode_worker_id": 1}}},
    {"nvext": {"worker_id": {"prefill_worker_id": "1"}}},
    {"nvext": {"worker_id": {"prefill_worker_id": True}}},
    [],
])
def test_anything_else_is_an_error(body):
    with pytest.raises(SseError):
        parse_route_answer(body)
