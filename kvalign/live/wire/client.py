"""OpenAI-compatible client for the Dynamo frontend: streaming chat + ``nvext`` parsing.

The router's decisions are observable only through stable response surfaces: with
``nvext.extra_fields = ["worker_id", "timing"]`` Dynamo adds ``nvext.worker_id``
(``prefill_worker_id``/``decode_worker_id``, in any chunk) and ``nvext.timing`` (final chunk;
``kv_hit_rate`` = the router's predicted overlap blocks / prompt blocks at the first hop). The
parser is pure (lines in, :class:`ChatResult` out) so it is unit-tested without a server; the
transport is ``requests`` with bounded timeouts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests

EXTRA_FIELDS = ("worker_id", "timing")


class SseError(ValueError):
    """A response stream that is not well-formed OpenAI SSE."""


@dataclass
class ChatResult:
    """What one streamed chat completion told us."""

    text: str = ""
    finish_reason: str | None = None
    prefill_worker_id: int | None = None
    decode_worker_id: int | None = None
    prefill_dp_rank: int | None = None
    decode_dp_rank: int | None = None
    timing: dict[str, Any] = field(default_factory=dict)
    usage: dict[str, Any] = field(default_factory=dict)
    chunks: int = 0
    done: bool = False
    #: the engine's output token ids (each chunk's ``nvext.completion_token_ids``, asked for with that
    #: extra field, concatenated; None when the stream carried none)
    token_ids: list[int] | None = None
    #: the request failed (HTTP error or an error in the stream), recorded by a run that expects some
    error: str | None = None

    @property
    def kv_hit_rate(self) -> float | None:
        v = self.timing.get("kv_hit_rate")
        return None if v is None else float(v)

    @property
    def prompt_tokens(self) -> int | None:
        v = self.usage.get("prompt_tokens")
        return None if v is None else int(v)


def _absorb_worker_ids(res: ChatResult, wid: Any) -> None:
    if not isinstance(wid, dict):
        raise SseError(f"nvext.worker_id is not an object: {wid!r:.80}")
    for key in ("prefill_worker_id", "decode_worker_id", "prefill_dp_rank", "decode_dp_rank"):
        v = wid.get(key)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool):
            raise SseError(f"nvext.worker_id.{key} is not an integer: {v!r:.40}")
        prev = getattr(res, key)
        if prev is not None and prev != v:
            raise SseError(f"nvext.worker_id.{key} changed within one response: {prev} -> {v}")
        setattr(res, key, v)


def parse_sse(lines: Iterable[str | bytes]) -> ChatResult:
    """Fold the ``data:`` lines of one chat-completion stream into a :class:`ChatResult`."""
    res = ChatResult()
    for raw in lines:
        line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        line = line.rstrip("\r\n")
        if not line or line.startswith(":") or line.startswith(("event:", "id:", "retry:")):
            continue
        if not line.startswith("data:"):
            raise SseError(f"unexpected SSE line: {line!r:.80}")
        data = line[5:].strip()
        if data == "[DONE]":
            res.done = True
            continue
        if res.done:
            raise SseError("data after [DONE]")
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as exc:
            raise SseError(f"SSE data is not JSON ({exc.msg}): {data!r:.80}") from None
        if not isinstance(chunk, dict):
            raise SseError(f"SSE data is not an object: {data!r:.80}")
        if "error" in chunk:
            raise SseError(f"server error in stream: {json.dumps(chunk['error'])[:200]}")
        res.chunks += 1
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            res.text += delta.get("content") or ""
            if choice.get("finish_reason"):
                res.finish_reason = choice["finish_reason"]
        nvext = chunk.get("nvext") or {}
        if "worker_id" in nvext:
            _absorb_worker_ids(res, nvext["worker_id"])
        if isinstance(nvext.get("timing"), dict):
            res.timing = nvext["timing"]
        if "completion_token_ids" in nvext:
            ids = nvext["completion_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise SseError(f"nvext.completion_token_ids is not a list of integers: {ids!r:.80}")
            res.token_ids = [*(res.token_ids or []), *ids]  # each chunk carries its own tokens' ids
        if isinstance(chunk.get("usage"), dict):
            res.usage = chunk["usage"]
    return res


def chat_payload(model: str, content: str | list[dict[str, Any]], *, max_tokens: int, extra_fields: Sequence[str] = EXTRA_FIELDS) -> dict[str, Any]:
    """The streaming request of Dynamo's router e2e tests, plus usage for the prompt length, greedy: the
    tiny target's constant logits decode to its leading word only under argmax (SGLang's CPU path verifies
    greedily whatever the request says; its CUDA path samples unless the temperature is 0)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
        "nvext": {"extra_fields": list(extra_fields)},
    }


def stream_chat(base_url: str, model: str, content: str | list[dict[str, Any]], *, max_tokens: int = 8,
                timeout_s: float = 60.0, extra_fields: Sequence[str] = EXTRA_FIELDS) -> ChatResult:
    """POST one streaming chat completion and parse it; HTTP errors raise with the body. ``content``:
    a string, or OpenAI content parts (text and ``image_url`` parts)."""
    with requests.post(
        f"{base_url}/v1/chat/completions",
        json=chat_payload(model, content, max_tokens=max_tokens, extra_fields=extra_fields),
        stream=True, timeout=(5.0, timeout_s),
    ) as resp:
        if resp.status_code != 200:
            raise SseError(f"HTTP {resp.status_code} from {base_url}: {resp.text[:300]}")
        res = parse_sse(resp.iter_lines(decode_unicode=False))
    if not res.done:
        raise SseError("stream ended without data: [DONE]")
    return res


def wait_ready(base_url: str, model: str, *, timeout_s: float, alive: Any = None) -> float:
    """Poll ``/v1/models`` until ``model`` is listed, then until one tiny request returns 200.

    ``alive`` is called each poll (e.g. :meth:`ProcessGroup.check_alive`) so a crashed process
    fails readiness at once instead of at the deadline. Returns the seconds it took.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    stage, last = "models", ""
    while time.monotonic() < deadline:
        if alive is not None:
            alive()
        try:
            if stage == "models":
                r = requests.get(f"{base_url}/v1/models", timeout=2.0)
                ids = [m.get("id") for m in r.json().get("data", [])] if r.status_code == 200 else []
                last = f"/v1/models -> {r.status_code} {ids}"
                if model in ids:
                    stage = "probe"
                    continue
            else:
                r = requests.post(f"{base_url}/v1/chat/completions", timeout=10.0, json={
                    "model": model, "messages": [{"role": "user", "content": "test"}], "max_tokens": 1, "stream": False})
                last = f"probe -> {r.status_code} {r.text[:200]}"
                if r.status_code == 200:
                    return time.monotonic() - start
        except (requests.RequestException, ValueError) as exc:
            last = f"{stage}: {type(exc).__name__}: {exc}"
        time.sleep(0.25)
    raise TimeoutError(f"frontend at {base_url} not ready for {model!r} after {timeout_s:.0f}s (last: {last})")


#: What a token-level completion asks Dynamo to report: the routing decision, the router's
#: prediction (``timing.kv_hit_rate``) and the generated ids (to extend a prompt with its output).
COMPLETION_FIELDS = ("worker_id", "timing", "completion_token_ids")


@dataclass
class Completion:
    """One non-streamed ``/v1/completions`` answer, reduced to what the live checks compare."""

    prompt_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens: the engine's own reuse
    completion_token_ids: list[int]
    prefill_worker_id: int | None
    decode_worker_id: int | None
    kv_hit_rate: float | None  # the router's prediction at the first hop
    timing: dict[str, Any] = field(default_factory=dict)
    #: the data-parallel rank the router chose on that worker (``nvext.worker_id.prefill_dp_rank``)
    prefill_dp_rank: int | None = None
    decode_dp_rank: int | None = None


def _int_or_none(v: Any, what: str) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise SseError(f"{what} is not an integer: {v!r:.40}")
    return v


def parse_completion(body: Any) -> Completion:
    """The fields of a completion response body; malformed bodies raise :class:`SseError`."""
    if not isinstance(body, dict):
        raise SseError(f"completion response is not an object: {body!r:.80}")
    if "error" in body:
        raise SseError(f"server error: {json.dumps(body['error'])[:200]}")
    usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    nvext = body.get("nvext") if isinstance(body.get("nvext"), dict) else {}
    wid = nvext.get("worker_id") if isinstance(nvext.get("worker_id"), dict) else {}
    timing = nvext.get("timing") if isinstance(nvext.get("timing"), dict) else {}
    details = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
    ids = nvext.get("completion_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise SseError(f"nvext.completion_token_ids is not a list of integers: {ids!r:.80}")
    prompt_tokens = _int_or_none(usage.get("prompt_tokens"), "usage.prompt_tokens")
    if prompt_tokens is None:
        raise SseError("completion response has no usage.prompt_tokens")
    rate = timing.get("kv_hit_rate")
    return Completion(
        prompt_tokens=prompt_tokens,
        cached_tokens=_int_or_none(details.get("cached_tokens"), "usage.prompt_tokens_details.cached_tokens"),
        completion_token_ids=list(ids),
        prefill_worker_id=_int_or_none(wid.get("prefill_worker_id"), "nvext.worker_id.prefill_worker_id"),
        decode_worker_id=_int_or_none(wid.get("decode_worker_id"), "nvext.worker_id.decode_worker_id"),
        kv_hit_rate=None if rate is None else float(rate),
        timing=timing,
        prefill_dp_rank=_int_or_none(wid.get("prefill_dp_rank"), "nvext.worker_id.prefill_dp_rank"),
        decode_dp_rank=_int_or_none(wid.get("decode_dp_rank"), "nvext.worker_id.decode_dp_rank"),
    )


def complete_tokens(base_url: str, model: str, tokens: Sequence[int], *, max_tokens: int,
                    pin: int | None = None, prefill_pin: int | None = None, cache_salt: str | None = None,
                    dp_rank: int | None = None, timeout_s: float = 120.0) -> Completion:
    """POST one greedy completion whose prompt is ``tokens`` (ids, no template: the router, the
    engine and kvalign then hash exactly the same sequence). ``pin``: an instance id the request
    must run on (``nvext.backend_instance_id``), instead of the router's choice; ``prefill_pin``: in
    disaggregation, the prefill instance (``nvext.prefill_worker_id``: ``backend_instance_id`` names
    the decode worker there, and a prefill id is rejected as invalid); ``cache_salt``:
    the tenant (``nvext.cache_salt``), which keys the engine's pages and the router's hashes;
    ``dp_rank``: with ``pin``, the data-parallel rank of that worker (``nvext.dp_rank``)."""
    nvext: dict[str, Any] = {"extra_fields": list(COMPLETION_FIELDS)}
    if pin is not None:
        nvext["backend_instance_id"] = pin
    if prefill_pin is not None:
        nvext["prefill_worker_id"] = prefill_pin
    if cache_salt:
        nvext["cache_salt"] = cache_salt
    if dp_rank is not None:
        nvext["dp_rank"] = dp_rank
    payload = {
        "model": model, "prompt": list(tokens), "max_tokens": max_tokens, "temperature": 0.0, "stream": False,
        "nvext": nvext,
    }
    resp = requests.post(f"{base_url}/v1/completions", json=payload, timeout=(5.0, timeout_s))
    if resp.status_code != 200:
        raise SseError(f"HTTP {resp.status_code} from {base_url}: {resp.text[:300]}")
    try:
        body = resp.json()
    except ValueError:
        raise SseError(f"completion response is not JSON: {resp.text[:120]!r}") from None
    return parse_completion(body)
