"""The ``ingest`` property: SGLang's real publisher -> Dynamo's real worker relay + event plane -> KvRouter.

Negative controls put a broken hop between SGLang's publisher and the real relay — one that drops
every batch carrying a cache_salt (Dynamo #14530's symptom), one that strips the salt (a salt-blind
relay), one that drops bigram batches (#5096) — and check the property names each cause from the
router's own index dump.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
from router_paths import open_router_path

from kvalign.verify.runner.check import run_search
from kvalign.verify.engine.properties import ingest_property
from kvalign.verify.engine.strategies import ingest_scenarios

EXAMPLES = 15


def _events(frames: list[bytes]) -> tuple[Any, list[Any]]:
    batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
    return batch, batch[1]


def _salt(ev: Any) -> Any:
    if isinstance(ev, dict):  # 0.5.23 tagged map
        return ev.get("cache_salt") or (ev.get("metadata") or {}).get("cache_salt")
    return next((x.get("cache_salt") for x in ev[7:] if isinstance(x, dict)), None)  # 0.5.19 positional


def _tokens(ev: Any) -> list[Any]:
    return ev.get("token_ids") or [] if isinstance(ev, dict) else ev[3] if len(ev) > 3 and isinstance(ev[3], list) else []


def drop_salted_batches(frames: list[bytes]) -> list[bytes] | None:
    """A relay that fails to decode a metadata-carrying event and loses its whole batch."""
    _, events = _events(frames)
    return None if any(_salt(e) for e in events) else frames


def strip_salt(frames: list[bytes]) -> list[bytes]:
    """A relay that ignores cache_salt: every event reaches the router unsalted."""
    batch, events = _events(frames)
    for ev in events:
        if isinstance(ev, dict):
            ev.pop("cache_salt", None)
            ev.pop("metadata", None)
        else:
            del ev[7:]
    return [frames[0], frames[1], msgpack.packb(batch, use_bin_type=True)]


def drop_bigram_batches(frames: list[bytes]) -> list[bytes] | None:
    """A relay that cannot decode bigram token_ids (EAGLE) and loses the batch."""
    _, events = _events(frames)
    return None if any(_tokens(e) and isinstance(_tokens(e)[0], list) for e in events) else frames


def _open(transform: Callable[[list[bytes]], Any] | None) -> Any:
    return open_router_path("real Dynamo router path unavailable", transform)


@pytest.fixture(scope="module")
def paths(sglang_available) -> Iterator[Callable[[Any], Any]]:
    """``paths(transform)``: one real RouterPath per hop kind, torn down at the end of the module."""
    opened: dict[Any, Any] = {}
    yield lambda transform=None: opened.setdefault(transform, _open(transform))
    for path in opened.values():
        path.close()


def _search(path: Any, router_hasher, cache_factory, *, eagle: bool, lora: bool = False, namespace: bool = False):
    make_cache = cache_factory("unified")
    return run_search(lambda isc: ingest_property(path, router_hasher, make_cache, isc),
                      ingest_scenarios(eagle=eagle, lora=lora, namespace=namespace), EXAMPLES)


@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
@pytest.mark.parametrize(("lora", "namespace"), [(False, False), (True, True)], ids=["base", "lora+namespace"])
def test_real_relay_and_router_reproduce_sglang_reuse(paths, router_hasher, cache_factory, count_case, eagle, lora, namespace):
    calls, failures, found = _search(paths(), router_hasher, cache_factory, eagle=eagle, lora=lora, namespace=namespace)
    for _ in range(calls):
        count_case()
    assert found is None, found
    assert calls == EXAMPLES and failures == 0


def test_relay_dropping_metadata_batches_is_events_dropped(paths, router_hasher, cache_factory):
    path = paths(drop_salted_batches)
    assert _search(path, router_hasher, cache_factory, eagle=True)[2] is None  # unsalted traffic is untouched
    calls, failures, found = _search(path, router_hasher, cache_factory, eagle=True, namespace=True)
    assert found is not None and failures > 0
    assert found.cause.name == "EVENTS_DROPPED" and "cache_salt=" in found.detail and "(metadata)" in found.detail


def test_salt_blind_relay_is_tenants_share_keys(paths, router_hasher, cache_factory):
    path = paths(strip_salt)
    calls, failures, found = _search(path, router_hasher, cache_factory, eagle=False, namespace=True)
    assert found is not None and found.cause.name == "TENANTS_SHARE_KEYS" and "without its cache_salt" in found.detail


def test_bigram_blind_relay_is_events_dropped_in_eagle_mode_only(paths, router_hasher, cache_factory):
    path = paths(drop_bigram_batches)
    assert _search(path, router_hasher, cache_factory, eagle=False)[2] is None
    found = _search(path, router_hasher, cache_factory, eagle=True)[2]
    assert found is not None and found.cause.name == "EVENTS_DROPPED" and "BlockStored[bigram" in found.detail


@pytest.mark.slow  # a RouterPath of its own (a runtime start and a search), then a stuck loop
def test_a_stuck_runtime_loop_is_path_unavailable_at_once_not_waited_on_per_call(sglang_available, router_hasher,
                                                                                 cache_factory, monkeypatch):
    """1.0.2's KvRouter once blocked the runtime's loop inside a pair's check: every later call then
    waited CALL_TIMEOUT_S while Hypothesis shrank, past the matrix's 600 s. After one call times out
    the path is wedged: the example is PATH_UNAVAILABLE and no later call is handed to the loop."""
    import asyncio
    import time

    from kvalign.oracles import router_path

    path = _open(None)
    try:
        assert _search(path, router_hasher, cache_factory, eagle=False)[2] is None  # a working path first
        handed: list[object] = []
        real = asyncio.run_coroutine_threadsafe
        monkeypatch.setattr(router_path.asyncio, "run_coroutine_threadsafe",
                            lambda coro, loop: handed.append(coro) or real(coro, loop))
        monkeypatch.setattr(router_path, "CALL_TIMEOUT_S", 0.3)
        path._loop.call_soon_threadsafe(time.sleep, 3.0)  # the loop stops answering, as it did
        calls, failures, found = _search(path, router_hasher, cache_factory, eagle=False)
        assert found is not None and found.cause.name == "PATH_UNAVAILABLE", found
        assert "did not return from" in found.detail and path.wedged
        assert len(handed) == 1 and calls >= 1  # the call that timed out; every later one failed at once
    finally:
        path.close()
