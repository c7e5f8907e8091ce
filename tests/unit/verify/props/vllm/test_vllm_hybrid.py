"""A hybrid model's groups on vLLM behind the real relay and router (``check --engine vllm``'s ``hybrid`` row).

vLLM's real ``KVCacheManager`` with a full-attention and a sliding-window group (window: two blocks) in one
pool publishes each group's stores and removals, tagged; Dynamo's real relay keeps the full-attention group's.
Checked: the router's index is vLLM's full-attention group, and vLLM never reuses more than the router credits.
Negative control: a hop stripping the group tags (``INGEST_STALE``). Candidate finding
(``SWA_STATE_NOT_REUSABLE``, as SGLang's hybrid property names it): the router credits full-attention blocks
whose sliding-window blocks vLLM evicted, and vLLM reuses none of them.
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
from kvalign.verify.props.vllm.hybrid import CONTROL_SEQUENCE, NUM_BLOCKS, credit_gap, hybrid_body, untag_groups
from kvalign.verify.props.vllm.strategies import fresh_base, sequences

B = 16


@pytest.fixture(scope="module")
def worker() -> Iterator[Any]:
    with vllm_on_router(B, NUM_BLOCKS, sliding_window=2 * B) as w:
        yield w


def test_vllm_publishes_each_groups_stores_tagged(worker):
    worker.engine.prefill([fresh_base() + i for i in range(2 * B)] + [1])
    stored = [(e["group_idx"], e["kv_cache_spec_kind"], len(e["block_hashes"])) for e in worker.sync()
              if e["type"] == "BlockStored"]
    assert stored == [(0, "full_attention", 2), (1, "sliding_window", 2)]


def test_the_routers_index_is_vllms_full_attention_group_and_never_under_credits(worker):
    cases, failures, found = run_search(hybrid_body(worker), sequences(B), 20, seed=0)
    assert (cases, failures, found) == (20, 0, None)


def test_negative_control_a_relay_taking_every_group_for_full_attention_is_caught(worker):
    with controls.on_hop(worker, untag_groups):
        _cases, _failures, found = run_search(hybrid_body(worker), st.just(CONTROL_SEQUENCE), 5, seed=0)
    assert found is not None and found.cause is Cause.INGEST_STALE
    assert "removed are still indexed" in found.detail


def test_finding_the_router_credits_blocks_whose_window_vllm_evicted(worker):
    """A prompt served twice: the second time vLLM's sliding-window group touches only the window before its
    hit, so the earlier window blocks stay least recently used; a short prompt then evicts them (``BlockRemoved``
    of group 1, which the relay skips). Every prefix of the first prompt is then credited in full by the
    router, and vLLM reuses none of it (no window before the prefix's end); the whole prompt, whose window
    blocks stayed, is reused."""
    base = fresh_base()
    first = [base + i for i in range(5 * B)] + [base + 999]
    worker.engine.prefill(first)
    worker.sync()
    assert worker.engine.prefill(first) == 5 * B
    worker.sync()
    worker.engine.prefill([base + 500 + i for i in range(2 * B)] + [base + 998])
    removed = [(e["group_idx"], len(e["block_hashes"])) for e in worker.sync() if e["type"] == "BlockRemoved"]
    assert removed and {g for g, _n in removed} == {1}
    gaps = [credit_gap(worker, first[: n * B] + [base + 997]) for n in range(1, 5)]
    assert gaps == [(1, 0), (2, 0), (3, 0), (4, 0)]
    assert credit_gap(worker, first) == (5, 5)
