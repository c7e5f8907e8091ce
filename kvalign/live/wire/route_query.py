"""Ask a frontend's KV router where it *would* send a prompt, without sending it.

Dynamo's frontend has a query-only path for external schedulers (the Gateway API inference
extension's first stage): a request annotated ``query_instance_id:`` (``nvext.annotations``, the
colon is part of the key) is routed by the KV router as usual, but never dispatched, and the
router updates none of its state (``KvPushRouter::generate``, 1.6.1: no active-sequence booking,
no approximate-mode routing record). The answer is ``nvext.worker_id`` — the chosen worker — and
``nvext.token_ids``; it carries no overlap figure. That is how kvalign reads what each router
replica's index says for the next prompt: a router that holds the prompt's pages on one worker
names that worker every time, and one that holds them nowhere (or everywhere) picks among its
tied workers at random, which a few repeated queries show.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import requests

from kvalign.live.wire.client import SseError

QUERY_ONLY = "query_instance_id:"


@dataclass(frozen=True)
class RouteAnswer:
    """The worker a router would route a prompt to (prefill and decode ids; equal when aggregated)."""

    prefill_worker_id: int
    decode_worker_id: int | None


def query_payload(model: str, tokens: Sequence[int], *, cache_salt: str | None = None) -> dict[str, Any]:
    """The query-only completion for ``tokens`` (token ids, as the fuzz sends them)."""
    nvext: dict[str, Any] = {"annotations": [QUERY_ONLY]}
    if cache_salt:
        nvext["cache_salt"] = cache_salt
    return {"model": model, "prompt": list(tokens), "max_tokens": 1, "stream": False, "nvext": nvext}


def parse_route_answer(body: Any) -> RouteAnswer:
    """The routing decision in a query-only answer; anything else raises :class:`SseError`."""
    nvext = body.get("nvext") if isinstance(body, dict) else None
    wid = nvext.get("worker_id") if isinstance(nvext, dict) else None
    if not isinstance(wid, dict):
        raise SseError(f"query-only answer has no nvext.worker_id: {str(body)[:160]}")
    prefill, decode = wid.get("prefill_worker_id"), wid.get("decode_worker_id")
    for key, v in (("prefill_worker_id", prefill), ("decode_worker_id", decode)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
            raise SseError(f"nvext.worker_id.{key} is not an integer: {v!r:.40}")
    if prefill is None:
        raise SseError(f"query-only answer names no prefill worker: {str(wid)[:160]}")
    return RouteAnswer(prefill, decode)


def query_route(base_url: str, model: str, tokens: Sequence[int], *, cache_salt: str | None = None,
                timeout_s: float = 30.0) -> RouteAnswer:
    """One query-only request to the frontend at ``base_url``."""
    resp = requests.post(f"{base_url}/v1/completions", json=query_payload(model, tokens, cache_salt=cache_salt),
                         timeout=(5.0, timeout_s))
    if resp.status_code != 200:
        raise SseError(f"HTTP {resp.status_code} from {base_url} (query-only): {resp.text[:300]}")
    try:
        return parse_route_answer(resp.json())
    except ValueError:
        raise SseError(f"query-only answer is not JSON: {resp.text[:120]!r}") from None


def route_choices(base_url: str, model: str, tokens: Sequence[int], *, asks: int, cache_salt: str | None = None) -> frozenset[int]:
    """The prefill workers a router names over ``asks`` query-only requests for the same prompt:
    one worker when its index holds the prompt best there, several when it breaks a tie."""
    return frozenset(query_route(base_url, model, tokens, cache_salt=cache_salt).prefill_worker_id for _ in range(asks))
