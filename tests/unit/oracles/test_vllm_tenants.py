"""tenants on vLLM: LoRA and ``cache_salt`` tenants kept apart by vLLM and by the real router alike, on
store and on eviction.

A tenant is ``(lora_name, namespace)``. vLLM gets the namespace as ``dynamo.vllm`` hands it over
(``dynamo-cache-salt:`` + the request's ``nvext.cache_salt``), the router's query gets it as
``cache_namespace``; for every tenant asking for every prompt, vLLM's prefix hit must equal the
prediction from the router's overlap (``B * min(R, (n - 1) // B)``). Negative control: a hop that
strips ``extra_keys`` and ``lora_name`` from vLLM's events (a tenant-blind relay): the router then
credits other tenants with a tenant's blocks.

Candidate finding, shown as it behaves: a salt that reaches vLLM *without* Dynamo's prefix (a client
sending vLLM's own ``cache_salt``, or any path that does not go through ``dynamo.vllm``'s handler)
salts vLLM's hashes but not the router's keys: the router credits an unsalted request with the salted
blocks, which vLLM will not reuse for it, and credits nothing to the salted tenant, which vLLM serves.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from router_paths import open_router_path
from vllm_paths import open_vllm_worker, rewrite_events, vllm_on_router

from kvalign.model.vllm_keys import dynamo_salt
from kvalign.verify.props.vllm.controls import tenant_blind

B = 16
NUM_BLOCKS = 14
TENANTS = [(None, None), ("adapterA", None), ("adapterB", None), (None, "t1"), (None, "t2"), ("adapterA", "t1")]
_ranges = itertools.count(1)


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    with vllm_on_router(B, NUM_BLOCKS) as w:
        yield w


def _prefill(worker: Any, tokens: list[int], lora: str | None, ns: str | None) -> None:
    worker.engine.prefill(tokens, lora_name=lora, cache_salt=dynamo_salt(ns) if ns else None)
    worker.sync()


def tenant_mismatches(worker: Any, tokens: list[int]) -> list[tuple[Any, int, int]]:
    """``(tenant, vLLM's hit, predicted hit)`` for each tenant whose hit the router's overlap mispredicts."""
    out = []
    for lora, ns in TENANTS:
        hit = worker.engine.match(tokens, lora_name=lora, cache_salt=dynamo_salt(ns) if ns else None)
        predicted = B * min(worker.overlap(tokens, lora_name=lora, cache_namespace=ns), (len(tokens) - 1) // B)
        if hit != predicted:
            out.append(((lora, ns), hit, predicted))
    return out


def _prompt(blocks: int = 3) -> list[int]:
    base = next(_ranges) * 1000
    return list(range(base, base + blocks * B)) + [base + 999] * 5


def test_each_tenant_is_credited_what_vllm_reuses_for_it(worker):
    for stored_by in TENANTS[1:]:
        tokens = _prompt()
        _prefill(worker, tokens, *stored_by)
        assert worker.engine.match(tokens, lora_name=stored_by[0],
                                   cache_salt=dynamo_salt(stored_by[1]) if stored_by[1] else None) == 3 * B
        assert tenant_mismatches(worker, tokens) == [], stored_by


def test_tenants_stay_apart_after_evictions(worker):
    tokens = _prompt()
    for tenant in [(None, "t1"), ("adapterA", None), (None, None)]:
        _prefill(worker, tokens, *tenant)
    _prefill(worker, _prompt(7), None, None)  # 13 usable blocks: evicts the least recently used
    assert tenant_mismatches(worker, tokens) == []
    assert worker.engine.match(tokens, cache_salt=dynamo_salt("t1")) < 3 * B  # an eviction did hit a tenant


def test_negative_control_a_tenant_blind_relay_is_caught(worker):
    tokens = _prompt()
    worker.hop.hop.transform = rewrite_events(tenant_blind)
    try:
        _prefill(worker, tokens, "adapterA", "t1")
    finally:
        worker.hop.hop.transform = None
    found = tenant_mismatches(worker, tokens)
    # the blocks are credited to the unsalted base tenant, which vLLM never serves them to, and not to
    # the tenant vLLM serves them to
    assert found == [((None, None), 0, 3 * B), (("adapterA", "t1"), 3 * B, 0)]


def test_finding_a_salt_without_dynamos_prefix_is_ignored_by_the_router(worker):
    tokens = _prompt()
    worker.engine.prefill(tokens, cache_salt="tenant-x")
    worker.sync()
    # vLLM: only the salted tenant reuses the blocks
    assert worker.engine.match(tokens) == 0 and worker.engine.match(tokens, cache_salt="tenant-x") == 3 * B
    # the router: the unsalted request is credited all 3 blocks, the salted tenant none
    assert worker.overlap(tokens) == 3 and worker.overlap(tokens, cache_namespace="tenant-x") == 0
