"""Opening vLLM behind the real relay -> router path in a test, and the broken hops negative controls use.

A vLLM engine is the real ``KVCacheManager`` in vLLM's own interpreter (:mod:`kvalign.oracles.vllm`);
when that environment cannot be installed the test skips naming why (a failure under
``KVALIGN_REQUIRE_REAL_PATHS=1``, as for the router path itself).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from router_paths import REQUIRE_ENV

from kvalign.oracles.base import OracleUnavailable

EventsFn = Callable[[list[dict[str, Any]]], list[dict[str, Any]]]


def open_vllm_worker(path: Any, block_size: int, num_blocks: int, **kw: Any) -> Any:
    """``vllm_worker(path, ...)``, or a skip naming the reason (a failure where real paths are required)."""
    from kvalign.oracles.vllm_router import vllm_worker

    try:
        return vllm_worker(path, block_size, num_blocks, **kw)
    except OracleUnavailable as exc:
        reason = f"vLLM behind the real router: {exc}"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1, but vLLM's path cannot start: {reason}", pytrace=False)
    pytest.skip(reason)


def rewrite_events(fn: EventsFn) -> Callable[[list[bytes]], list[bytes] | None]:
    """A hop transform applying ``fn`` to each vLLM batch's events (maps with ``type``); a batch left
    empty is dropped. Barrier batches (one root block, no parent) go through untouched."""

    def transform(frames: list[bytes]) -> list[bytes] | None:
        batch = msgspec.msgpack.decode(frames[2])
        events = batch[1]
        if len(events) == 1 and events[0].get("type") == "BlockStored" and events[0].get("lora_id") is None \
                and len(events[0]["block_hashes"]) == 1 and events[0]["block_hashes"][0] >= 1 << 62:
            return frames
        batch[1] = fn(events)
        if not batch[1]:
            return None
        return [frames[0], frames[1], msgspec.msgpack.encode(batch)]

    return transform
