"""What a request stores and whether the engine's stream shows it (kvalign/live/runs/fuzz/stores.py): the
fuzz settles on this after each answer instead of a quiet window, so a page it does not wait for is a
page the next request could find the engine holding and kvalign's view not (a false alarm)."""

from __future__ import annotations

from kvalign.live.runs.fuzz.stores import cached_tokens_after, stored_page_range, stored_pages, stores_seen
from kvalign.model.events import BlockRemoved, BlockStored, EventBatch
from kvalign.model.sglang_keys import engine_block_hashes, page_units

B = 16
PROMPT = list(range(100, 150))  # 50 tokens
OUTPUT = list(range(300, 316))  # 16 generated


def store(tokens: list[int], first: int, last: int, *, salt: str | None = None, parent: bool = True) -> BlockStored:
    """SGLang's store of pages ``first..last-1`` of ``tokens`` (EAGLE bigram pages)."""
    hashes = engine_block_hashes(tokens, B, eagle=True)
    units = page_units(tokens, B, eagle=True)
    return BlockStored(hashes[first:last], hashes[first - 1] if first and parent else None,
                       [u for page in units[first:last] for u in page], B, cache_salt=salt)


def batches(*events: list) -> list[EventBatch]:
    return [EventBatch(float(i), list(evs), 0, "map", i) for i, evs in enumerate(events)]


def test_a_request_caches_at_most_its_prompt_and_output() -> None:
    assert cached_tokens_after(PROMPT, OUTPUT, decodes=True) == [*PROMPT, *OUTPUT]
    assert cached_tokens_after(PROMPT, OUTPUT, decodes=False) == PROMPT  # a prefill worker: the prompt alone
    assert cached_tokens_after(PROMPT, OUTPUT[:1], decodes=True) == PROMPT  # one token: no decode step
    assert stored_pages(50, B, eagle=True) == 3 and stored_pages(48, B, eagle=False) == 3 and stored_pages(0, B, eagle=True) == 0


def test_the_stores_count_once_the_finish_batch_is_seen() -> None:
    """Prefill stores the prompt's 3 pages, the finish stores page 3 (with output): seen only after both."""
    cached = cached_tokens_after(PROMPT, OUTPUT, decodes=True)
    prefill, finish = [store(cached, 0, 3)], [store(cached, 3, 4)]
    assert stores_seen(batches(prefill), 0, cached, 0, B, eagle=True) == 3
    assert stores_seen(batches(prefill, finish), 0, cached, 0, B, eagle=True) == 4


def test_pages_held_at_the_routing_mark_need_no_new_store() -> None:
    cached = cached_tokens_after(PROMPT, OUTPUT, decodes=True)
    s = batches([store(cached, 0, 3)], [store(cached, 3, 4)])
    assert stores_seen(s, 1, cached, 3, B, eagle=True) == 4  # routed after the first batch: 3 held, page 3 stored since
    assert stores_seen(s, 2, cached, 3, B, eagle=True) == 3  # negative control: page 3's store came before the mark


def test_a_store_evicted_in_its_own_batch_was_still_seen() -> None:
    cached = list(PROMPT)
    hashes = engine_block_hashes(cached, B, eagle=True)
    s = batches([store(cached, 0, 3), BlockRemoved(hashes[:3])])
    assert stores_seen(s, 0, cached, 0, B, eagle=True) == 3


def test_a_salted_page_is_matched_in_its_tenants_key_space() -> None:
    """Only the first store of a chain carries the salt; the next inherits it from its parent, which the
    relay knows only from the batches before the mark (so the whole stream since the epoch is replayed)."""
    cached = cached_tokens_after(PROMPT, OUTPUT, decodes=True)
    s = batches([store(cached, 0, 3, salt="tenant-a")], [store(cached, 3, 4)])
    assert stores_seen(s, 1, cached, 3, B, eagle=True, namespace="tenant-a") == 4
    assert stores_seen(s, 1, cached, 3, B, eagle=True) == 3  # negative control: the unsalted key space has no page 3


def test_the_page_range_follows_the_live_engine() -> None:
    """(prompt, generated, pages stored) measured on SGLang 0.5.23 (EAGLE3, page 16, through the fuzz
    cluster): every count lies in the range, and the range is one page wide only at a boundary."""
    live = [(50, 15, 3), (34, 15, 2), (50, 14, 3), (49, 16, 4), (66, 15, 4), (40, 9, 2), (41, 9, 3), (300, 5, 18),
            (100, 13, 6)]
    for n, m, pages in live:
        lo, hi = stored_page_range(n, m, B, eagle=True, decodes=True)
        assert lo <= pages <= hi and hi - lo <= 1, (n, m, pages)
    assert stored_page_range(49, 16, B, eagle=True, decodes=False) == (3, 3)  # a prefill worker: the prompt alone
    assert stored_page_range(48, 1, B, eagle=True, decodes=True) == (2, 2)  # one token: no decode step, no KV for it
    assert stored_page_range(41, 9, B, eagle=True, decodes=True) == (3, 3)
