"""kvalign.model.sglang_keys against SGLang's real radix cache (CPU): pages, payloads, event hashes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvalign.model.events import BlockStored
from kvalign.oracles.sglang import SglangRadixCache, lora_id_for
from kvalign.model.sglang_keys import (
    engine_block_hashes,
    event_namespace,
    event_page_windows,
    page_count,
    page_units,
    page_windows,
    raw_window,
)
from kvalign.verify.engine.strategies import PAGE_SIZES, token_ids

#: These properties cost a few milliseconds a case (one small real cache each), so even the fast tier runs
#: 300 of each: part of its 5,000 generated cases.
CHEAP = settings(max_examples=max(300, settings.default.max_examples))


def stored_pages(cache: SglangRadixCache) -> list[tuple[int, list]]:
    """(engine hash, page units) for every page in the cache's pending BlockStored events."""
    out = []
    for ev in cache.take_events():
        if isinstance(ev, BlockStored):
            assert ev.block_size == cache.page_size
            for i, h in enumerate(ev.block_hashes):
                out.append((h, ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]))
    return out


@CHEAP
@given(
    tokens=token_ids(max_size=70, vocab=5),
    page_size=st.sampled_from(PAGE_SIZES),
    eagle=st.booleans(),
    lora=st.sampled_from([None, "loraA", "ü-名前"]),
    salt=st.sampled_from([None, "tenant-1"]),
    dynamo_format=st.booleans(),
)
def test_fresh_prompt_pages_payloads_and_hashes_equal_sglang(sglang_available, count_case, tokens, page_size, eagle, lora, salt, dynamo_format):
    count_case()
    assert_engine_matches_page_model(tokens, page_size, eagle, lora, salt, dynamo_format)


def assert_engine_matches_page_model(tokens, page_size, eagle, lora, salt, dynamo_format, *, model_eagle=None):
    """Real SGLang's pages for ``tokens`` == kvalign's page model (framed as ``model_eagle``)."""
    model_eagle = eagle if model_eagle is None else model_eagle
    cache = SglangRadixCache(page_size, eagle=eagle, dynamo_format=dynamo_format)
    cache.insert(tokens, lora_name=lora, cache_salt=salt)
    pages = stored_pages(cache)
    namespace = event_namespace(lora_id_for(lora) if lora else None, salt, lora_registered=bool(lora), dynamo_format=dynamo_format)
    assert [h for h, _ in pages] == engine_block_hashes(tokens, page_size, eagle=model_eagle, cache_salt=salt, namespace=namespace)
    assert [list(u) for _, u in pages] == page_units(tokens, page_size, eagle=model_eagle)
    assert [tuple(raw_window(u)) for _, u in pages] == page_windows(tokens, page_size, eagle=model_eagle)
    assert len(pages) == page_count(len(tokens), page_size, eagle=model_eagle)
    assert cache.match(tokens, lora_name=lora, cache_salt=salt) == len(pages) * page_size


@pytest.mark.parametrize("eagle", [False, True])
def test_negative_control_misframed_page_model_is_detected(sglang_available, eagle):
    """The comparison above fails when kvalign frames pages the other way (B vs B+1 windows)."""
    tokens = list(range(1, 18))
    assert_engine_matches_page_model(tokens, 4, eagle, None, None, False)
    with pytest.raises(AssertionError):
        assert_engine_matches_page_model(tokens, 4, eagle, None, None, False, model_eagle=not eagle)


@CHEAP
@given(doc=token_ids(min_size=1, max_size=40, vocab=3), cut=st.integers(0, 40), page_size=st.sampled_from(PAGE_SIZES), eagle=st.booleans())
def test_match_prefix_is_page_aligned_over_shared_raw_tokens(sglang_available, count_case, doc, cut, page_size, eagle):
    """SGLang reuses floor(S/P) pages (plain) or floor((S-1)/P) pages (EAGLE) for S shared raw tokens."""
    count_case()
    cache = SglangRadixCache(page_size, eagle=eagle)
    cache.insert(doc)
    query = doc[:cut] + [99]
    shared = min(cut, len(doc))
    expected = page_count(shared, page_size, eagle=eagle)
    assert cache.match(query) == expected * page_size


def test_multi_page_event_splits_into_windows(sglang_available):
    cache = SglangRadixCache(4, eagle=True)
    cache.insert(list(range(1, 11)))
    (ev,) = [e for e in cache.take_events() if isinstance(e, BlockStored)]
    assert event_page_windows(ev.token_ids, ev.block_size, len(ev.block_hashes)) == [[1, 2, 3, 4, 5], [5, 6, 7, 8, 9]]


def test_raw_window_rejects_broken_bigram_chain():
    assert raw_window([(1, 2), (2, 3)]) == [1, 2, 3]
    with pytest.raises(ValueError, match="breaks its chain at element 1"):
        raw_window([(1, 2), (5, 6)])
    assert raw_window([(1, 2), (5, 6)], strict=False) == [1, 5, 6]  # what Dynamo would hash
