"""Requests through SGLang's own scheduler code (kvalign.oracles.admission), on the HiCache engine.

The cap is SGLang's (``Req._compute_max_prefix_len``, lowered by ``logprob_start_len``); the device
allocator is SGLang's own and bounded, so a full pool makes SGLang evict on allocation (its
``evict_for_alloc``), which a pool with room never does (the negative control).
"""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def engine(sglang_available: str) -> Any:
    from kvalign.oracles.hicache import HiCacheEngine
    from kvalign.standins.hicache import version_problem

    if version_problem(sglang_available):
        pytest.skip(version_problem(sglang_available))
    return lambda **kw: HiCacheEngine(4, eagle=False, core="unified", host_tokens=1 << 20,
                                      **{"policy": "write_through", **kw})


def test_the_cap_is_sglangs_own_and_logprob_start_len_lowers_it(engine):
    e = engine()
    prompt = list(range(1, 9))  # two pages
    e.serve(prompt)
    again = e.serve(prompt)
    assert (again.max_prefix_tokens, again.device_tokens, again.cached_tokens) == (7, 4, 4)  # the last page: recomputed
    longer = e.serve(prompt + [9])
    assert (longer.max_prefix_tokens, longer.device_tokens) == (8, 8)
    logprobs = e.serve(prompt + [9], logprob_start_len=5)  # logprobs from token 5 on: SGLang matches at most 5
    assert (logprobs.max_prefix_tokens, logprobs.device_tokens) == (5, 4)


def _spy_evict_for_alloc(e: Any) -> list[int]:
    """Count SGLang's own evictions on allocation (the call goes through to SGLang's method)."""
    calls: list[int] = []
    original = e.cache.evict_for_alloc

    def evict_for_alloc(params: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(int(params.num_tokens))
        return original(params, *args, **kwargs)

    e.cache.evict_for_alloc = evict_for_alloc
    return calls


@pytest.mark.parametrize("device_tokens", [16, None], ids=["full-pool", "room-control"])
def test_a_full_device_pool_makes_sglang_evict_on_allocation(engine, device_tokens):
    """Write-back, 4 device pages: the third 6-token request finds the pool short, and SGLang's allocation
    path evicts the least recent page, writing it back to host first."""
    e = engine(policy="write_back", device_tokens=device_tokens)
    calls = _spy_evict_for_alloc(e)
    e.take_raw_events()
    for i in range(4):
        assert e.serve([10 * i + j for j in range(1, 7)]).admitted
    events = [(type(ev).__name__, getattr(ev.medium, "value", ev.medium)) for ev in e.take_raw_events()]
    assert e.available_tokens() <= (device_tokens or e.device_tokens)  # every freed slot was one SGLang allocated
    if device_tokens is None:
        assert calls == [] and ("BlockRemoved", "GPU") not in events
        return
    assert calls and ("BlockStored", "CPU_PINNED") in events and ("BlockRemoved", "GPU") in events
    assert e.residency([1, 2, 3, 4]).host == 1  # the first request's page: demoted to host, not lost


def test_a_request_larger_than_the_pool_is_deferred_not_admitted(engine):
    """SGLang's prefill budget (extend + one output token + a page) does not fit a 4-page pool: NO_TOKEN."""
    a = engine(device_tokens=16).serve(list(range(1, 17)))
    assert not a.admitted and a.result == "NO_TOKEN" and a.cached_tokens == 0
