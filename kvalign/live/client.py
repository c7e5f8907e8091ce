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
        if isinstance(chunk.get("usage"), dict):
            res.usage = chunk["usage"]
    return res


def chat_payload(model: str, content: str, *, max_tokens: int, extra_fields: Sequence[str] = EXTRA_FIELDS) -> dict[str, Any]:
    """The streaming request of Dynamo's router e2e tests, plus usage for the prompt length."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "stream": True,
        "max_tokens": max_tokens,
        "stream_options": {"include_usage": True},
        "nvext": {"extra_fields": list(extra_fields)},
    }


def stream_chat(base_url: str, model: str, content: str, *, max_tokens: int = 8, timeout_s: float = 60.0) -> ChatResult:
    """POST one streaming chat completion and parse it; HTTP errors raise with the body."""
    with requests.post(
        f"{base_url}/v1/chat/completions", json=chat_payload(model, content, max_tokens=max_tokens),
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
