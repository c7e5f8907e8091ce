"""Opening vLLM behind the real relay -> router path in a test (the broken hops negative controls put on it:
:func:`kvalign.verify.props.vllm.controls.rewrite_events`, re-exported).

A vLLM engine is the real ``KVCacheManager`` in vLLM's own interpreter (:mod:`kvalign.oracles.vllm`);
when that environment cannot be installed the test skips naming why (a failure under
``KVALIGN_REQUIRE_REAL_PATHS=1``, as for the router path itself).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
from router_paths import REQUIRE_ENV, open_router_path

from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.props.vllm.controls import rewrite_events

__all__ = ["open_vllm_worker", "rewrite_events", "vllm_on_router"]


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


@contextlib.contextmanager
def vllm_on_router(block_size: int, num_blocks: int, **kw: Any) -> Iterator[Any]:
    """A vLLM worker behind a real relay -> router path of its own, both closed on exit (a module's fixture)."""
    path = open_router_path("the relay -> KvRouter path for vLLM's events")
    worker = None
    try:
        worker = open_vllm_worker(path, block_size, num_blocks, **kw)
        yield worker
    finally:
        if worker is not None:
            worker.close()
        path.close()
