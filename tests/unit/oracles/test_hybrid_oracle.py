"""The hybrid-model oracle against SGLang's own unit-test kit, which builds the same caches.

``HybridCache`` mirrors ``sglang.test.kits.unified_radix_cache.fixtures.build_fixture`` (the kit
asks ``get_device()``, which has no CPU answer, and its config module imports SGLang's benchmark
stack). Here the kit's own builder runs, with those two stood in for the test only, and both caches
get the same inserts and evictions: the events and the matches must be the same.
"""

from __future__ import annotations

import sys
import types
import unittest
from array import array
from typing import Any

import pytest

SEQ_A = list(range(1, 17))
SEQ_B = SEQ_A[:8] + list(range(100, 108))


@pytest.fixture(scope="module")
def kit(sglang_available: str) -> Any:
    """SGLang's ``build_fixture``, importable on CPU (a test-only shim for its two GPU-box assumptions)."""
    from kvalign.oracles.sglang import _modules

    _modules()
    saved = sys.modules.get("sglang.test.test_utils")
    utils = types.ModuleType("sglang.test.test_utils")
    utils.CustomTestCase = unittest.TestCase  # type: ignore[attr-defined]
    sys.modules["sglang.test.test_utils"] = utils
    try:
        import sglang.test.kits.unified_radix_cache.fixtures as fixtures
        from sglang.test.kits.unified_radix_cache.config import CacheConfig
    except ImportError as exc:
        pytest.skip(f"SGLang {sglang_available} ships no unified_radix_cache test kit: {exc}")
    finally:
        if saved is None:
            sys.modules.pop("sglang.test.test_utils", None)
        else:
            sys.modules["sglang.test.test_utils"] = saved
    fixtures.get_device = lambda *_: "cpu"
    return fixtures, CacheConfig


def _kit_insert(cache: Any, allocator: Any, pool: Any, cfg: Any, tokens: list[int], rid: list[int]) -> None:
    """The kit's ``UnifiedRadixCacheFixtures._insert`` (and ``_alloc``), as its tests call it."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.sampling.sampling_params import SamplingParams

    key = RadixKey(array("q", tokens))
    if cfg.has_swa and cfg.page_size > 1:
        p = cfg.page_size
        aligned = (len(tokens) + p - 1) // p * p
        full, swa = allocator.full_attn_allocator.alloc(aligned), allocator.swa_attn_allocator.alloc(aligned)
        allocator.full_to_swa_index_mapping[full] = swa
        value = full[: len(tokens)]
    else:
        value = allocator.alloc(len(tokens))
    params = InsertParams(key=key, value=value[: len(key)])
    if cfg.has_mamba:
        req = Req(rid=rid[0], origin_input_text="", origin_input_ids=array("q"),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        rid[0] += 1
        pool.alloc([req])
        params.mamba_value = req.kv.mamba_pool_idx.unsqueeze(0)
    cache.insert(params)


def _shape(events: list[Any]) -> list[tuple[Any, ...]]:
    return [(type(e).__name__, list(getattr(e, "block_hashes", [])), getattr(e, "parent_block_hash", None))
            for e in events]


@pytest.mark.parametrize("component,page_size,eagle", [("swa", 2, False), ("swa", 4, True), ("mamba", 1, False),
                                                       ("mamba", 4, False)])
@pytest.mark.slow  # fast tier: the negative controls and the fixed counterexamples
def test_oracle_equals_sglang_kit(kit: Any, component: str, page_size: int, eagle: bool) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType as CT

    from kvalign.oracles.hybrid import HybridCache, Reuse

    fixtures, CacheConfig = kit
    if component == "swa":
        cfg = CacheConfig(page_size=page_size, components=(CT.FULL, CT.SWA), sliding_window_size=4, is_eagle=eagle)
    else:
        cfg = CacheConfig(page_size=page_size, components=(CT.FULL, CT.MAMBA), is_eagle=eagle,
                          enable_mamba_extra_buffer=page_size > 1, mamba_cache_size=60)
    theirs, allocator, pool = fixtures.build_fixture(cfg, enable_kv_cache_events=True, tree_core_backend="python")
    ours = HybridCache(component, page_size, eagle=eagle, window=4, core="python")
    theirs.take_events()
    rid = [0]
    for tokens in (SEQ_A, SEQ_B):
        _kit_insert(theirs, allocator, pool, cfg, tokens, rid)
        ours.insert(tokens)
    assert _shape(ours.take_raw_events()) == _shape(theirs.take_events())
    state = EvictParams(num_tokens=0, swa_num_tokens=4) if component == "swa" else EvictParams(num_tokens=0, mamba_num=1)
    for step in (state, EvictParams(num_tokens=page_size)):
        theirs.evict(step)
        if step.num_tokens:
            ours.evict(step.num_tokens)
        else:
            ours.evict_state(4 if component == "swa" else 1)
        assert _shape(ours.take_raw_events()) == _shape(theirs.take_events())
        for q in (SEQ_A, SEQ_B, SEQ_A[:8], SEQ_A[:10]):
            m = theirs.match_prefix(MatchPrefixParams(key=RadixKey(array("q", q))))
            assert ours.match(q) == Reuse(int(m.device_prefix_len), int(m.full_kv_hit_length))


def test_mamba_tree_is_keyed_plain_under_eagle(sglang_available: str) -> None:
    """Read from SGLang's source: a Mamba tree drops EAGLE's bigram keys, an SWA tree keeps them."""
    from kvalign.oracles.hybrid import HybridCache, eagle_allowed

    assert eagle_allowed("swa") is None
    assert "plain tokens" in (eagle_allowed("mamba") or "")
    assert HybridCache("mamba", 1, eagle=True, core="python").eagle_keys == 0
    assert HybridCache("swa", 2, eagle=True, core="python").eagle_keys == 1


def test_unknown_component_is_an_error(sglang_available: str) -> None:
    from kvalign.oracles.hybrid import HybridCache

    with pytest.raises(ValueError, match="unknown hybrid component"):
        HybridCache("c128", 4, eagle=False)


def test_other_releases_are_skipped_with_a_reason() -> None:
    from kvalign.oracles.hybrid import version_problem
    from kvalign.standins.hicache_storage import version_problem as storage_problem

    assert version_problem("0.5.23") is None and storage_problem("0.5.23") is None
    assert "pinned to SGLang 0.5.23" in (version_problem("0.5.21") or "")
    assert "pinned to SGLang 0.5.23" in (storage_problem("0.5.21") or "")


@pytest.mark.parametrize("core", ["rust", "python"])
def test_a_decoded_request_is_cached_behind_its_window_without_an_event(sglang_available: str, core: str) -> None:
    """SGLang's production SWA path (issue 43): while a request decodes, its window slots behind the sliding
    window are freed (``evict_sliding_windows``, SGLang's own code on the request's row), and the finished
    request is cached with that evicted length. The free publishes nothing; the insert publishes every page's
    full-attention KV as stored, while a prefix ending behind the window is not reusable. The negative control
    is the same request cached as the kit caches one (``insert``, window intact): every prefix is reusable."""
    from kvalign.oracles.hybrid import HybridCache

    tokens = [10 + i for i in range(16)]
    decoded = HybridCache("swa", 2, eagle=False, window=4, core=core)
    evicted = decoded.insert_decoded(tokens)
    events = decoded.take_raw_events()
    assert evicted == 10 and [type(e).__name__ for e in events] == ["BlockStored"], (evicted, events)
    assert len(events[0].block_hashes) == 8
    behind, inside = decoded.match(tokens[:8] + [99]), decoded.match(tokens[:14] + [99])
    assert (behind.full, behind.reusable) == (8, 0) and inside.reusable == 14, (behind, inside)
    whole = HybridCache("swa", 2, eagle=False, window=4, core=core)
    assert whole.insert(tokens) == 0 and whole.match(tokens[:8] + [99]).reusable == 8
    with pytest.raises(ValueError, match="sliding-window path"):
        HybridCache("mamba", 1, eagle=False, core=core).insert_decoded(tokens)
