"""vLLM's media and its CPU offload tier behind the real relay and router (``check --engine vllm``'s ``tiers`` row).

vLLM's real ``KVCacheManager`` (device, ``GPU``) and the offload connector's real ``CPUOffloadingManager`` and
``OffloadingEventsTracker`` (``CPU``; :mod:`kvalign.oracles.vllm_offload`) publish into Dynamo's real relay.
Checked: each medium's router tier; before each prompt, the router's device credit = vLLM's device hit and its
device + host credit = what vLLM holds after the connector's load. Negative control: a hop filing ``CPU`` as
``GPU`` (``TIER_MISFILED``). Chunks of several blocks (vllm#57159): test_tiers_chunks.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import strategies as st
from vllm_paths import vllm_on_router

from kvalign.model.causes import Cause
from kvalign.verify.engine.search import run_search
from kvalign.verify.props.vllm import controls
from kvalign.verify.props.vllm.strategies import fresh_base
from kvalign.verify.props.vllm.tiers import (CONTROL_SEQUENCE, MEDIA, OFFLOAD, Credit, cpu_as_gpu, credit, judge,
                                             tier_sequences, tiers_body)

B = 16


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    with vllm_on_router(B, 10, offload=OFFLOAD) as w:
        yield w


def _medium(m: str | None) -> Any:
    def rewrite(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for e in events:
            if e.get("type") in ("BlockStored", "BlockRemoved"):
                e["medium"] = m
        return events
    return rewrite


def test_each_medium_is_filed_under_its_tier_and_unknown_media_nowhere(worker):
    tier = {"device": "device_blocks", "host_pinned": "host_pinned_extension_blocks", "disk": "disk_extension_blocks"}
    seen = {}
    for medium in [*MEDIA, "cpu", "HOST", "foo"]:
        tokens = [fresh_base() + i for i in range(B)] + [1]
        with controls.on_hop(worker, _medium(medium)):
            worker.engine.prefill(tokens)
            worker.sync()
        seen[medium] = {k for k, v in worker.tiers(tokens).items() if v}
    assert seen == {**{m: {tier[t]} for m, t in MEDIA.items()}, "cpu": set(), "HOST": set(), "foo": set()}


def test_the_routers_tiers_equal_what_vllms_device_cache_and_cpu_tier_serve(worker):
    cases, failures, found = run_search(tiers_body(worker), tier_sequences(B), 20, seed=0)
    assert (cases, failures, found) == (20, 0, None)


def test_an_evicted_prompt_is_credited_from_the_cpu_tier_and_loaded_from_it(worker):
    base = fresh_base()
    prompts = [s.tokens(base, B) for s in CONTROL_SEQUENCE]
    for tokens in prompts[:-1]:
        worker.engine.prefill(tokens)
        worker.sync()
    assert credit(worker, prompts[-1]) == Credit(device=0, host=3, vllm_device=0, vllm_loaded=3)


def test_negative_control_a_relay_filing_cpu_as_device_is_caught(worker):
    with controls.on_hop(worker, cpu_as_gpu):
        _cases, _failures, found = run_search(tiers_body(worker), st.just(CONTROL_SEQUENCE), 5, seed=0)
    assert found is not None and found.cause is Cause.TIER_MISFILED
    assert "prompt 4: the router credits 3 device blocks, vLLM's device cache holds 0" in found.detail


def test_judge_names_each_disagreement():
    assert judge(Credit(2, 1, 2, 3)) is None
    assert judge(Credit(2, 0, 1, 2))[0] is Cause.TIER_MISFILED
    assert judge(Credit(1, 2, 1, 1))[0] is Cause.HOST_CREDIT_NOT_SERVABLE
    assert judge(Credit(1, 0, 1, 2))[0] is Cause.EVENTS_DROPPED
