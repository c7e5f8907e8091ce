"""A hybrid model's groups on vLLM behind the real relay and router (``check --engine vllm``'s ``hybrid`` rows).

vLLM's real ``KVCacheManager`` with a full-attention and a sliding-window group (window: two blocks) in one
pool publishes each group's stores and removals, tagged; Dynamo's real relay keeps the full-attention group's.
Checked: the router's index is vLLM's full-attention group, and vLLM never reuses more than the router credits.
Negative control: a hop stripping the group tags (``INGEST_STALE``). Candidate finding
(``SWA_STATE_NOT_REUSABLE``, as SGLang's hybrid property names it): the router credits full-attention blocks
whose sliding-window blocks vLLM evicted, and vLLM reuses none of them.

The same on a full-attention + Mamba cache (variant ``mamba``) in vLLM's default ``'align'`` mode, its prefills split
by vLLM's scheduler's own rule: the relay skips the Mamba group's stores, and the router credits every full-attention
block of a prefix while vLLM reuses only up to a kept Mamba state (``MAMBA_STATE_NOT_REUSABLE``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from router_paths import open_router_path
from vllm_paths import vllm_on_router

from kvalign.model.causes import CACHE_BLIND, Cause, cause_class
from kvalign.verify.engine.search import run_search
from kvalign.verify.props.vllm import controls, hybrid
from kvalign.verify.props.vllm.hybrid import (CONTROL_SEQUENCE, COPIES_CAUSE, COPIES_SEQUENCE, MAMBA_CONTROL_SEQUENCE,
                                              MAMBA_GAP_CAUSE, NUM_BLOCKS, control_cause, credit_gap,
                                              full_attention_blocks, hybrid_body, reads_group_tags, untag_groups)
from kvalign.verify.props.vllm.strategies import fresh_base, sequences

B = 16
ROOT = Path(__file__).resolve().parents[5]
#: each kind's engine: full attention + a window of two blocks, or + a Mamba group
OPTIONS: dict[str, dict[str, Any]] = {"swa": {"sliding_window": 2 * B}, "mamba": {"mamba": True}}


@pytest.fixture(scope="module")
def hybrid_worker() -> Iterator[Callable[[str | None], Any]]:
    """``open(kind)``: the module's one hybrid worker, of that kind (None: none open). Switching closes the other
    first, so the file holds one vLLM child at a time (a closed engine's child builds the next one's cache)."""
    stack, current = contextlib.ExitStack(), {}

    def open_(kind: str | None) -> Any:
        if kind not in current:
            stack.close()
            current.clear()
            if kind is not None:
                current[kind] = stack.enter_context(vllm_on_router(B, NUM_BLOCKS, **OPTIONS[kind]))
        return current.get(kind)

    with stack:
        yield open_


@pytest.fixture
def worker(hybrid_worker: Callable[[str | None], Any]) -> Any:
    return hybrid_worker("swa")


@pytest.fixture
def mamba_worker(hybrid_worker: Callable[[str | None], Any]) -> Any:
    return hybrid_worker("mamba")


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


def test_vllm_keeps_a_mamba_state_only_where_its_scheduler_ends_a_prefill_step(mamba_worker):
    """A 5-block prompt and a token: vLLM's scheduler splits the prefill at the last block boundary before the
    prompt's last token (80 of 81 tokens, then 1), so the Mamba group stores one state, at the fifth block's hash,
    tagged ``mamba``; the full-attention group stores all five."""
    base = fresh_base()
    mamba_worker.engine.prefill([base + i for i in range(5 * B)] + [base + 999])
    stored = [(e["group_idx"], e["kv_cache_spec_kind"], e["block_hashes"]) for e in mamba_worker.sync()
              if e["type"] == "BlockStored"]
    assert [(g, kind, len(hashes)) for g, kind, hashes in stored] == [(0, "full_attention", 5), (1, "mamba", 1)]
    assert stored[1][2] == stored[0][2][-1:]


def test_the_routers_index_is_vllms_full_attention_group_beside_a_mamba_group(mamba_worker):
    cases, failures, found = run_search(hybrid_body(mamba_worker), sequences(B), 20, seed=0)
    assert (cases, failures, found) == (20, 0, None)


def test_negative_control_a_relay_taking_the_mamba_group_for_full_attention_is_caught(mamba_worker):
    assert run_search(hybrid_body(mamba_worker), st.just(MAMBA_CONTROL_SEQUENCE), 5, seed=0)[1:] == (0, None)
    with controls.on_hop(mamba_worker, untag_groups):
        _cases, _failures, found = run_search(hybrid_body(mamba_worker), st.just(MAMBA_CONTROL_SEQUENCE), 5, seed=0)
    assert found is not None and found.cause is Cause.INGEST_STALE
    assert "removed are still indexed" in found.detail


def test_finding_the_router_credits_blocks_past_vllms_last_mamba_state(mamba_worker):
    """MAMBA_STATE_NOT_REUSABLE on vLLM (cache-blind, the row's class for it): after a 5-block prompt, every
    shorter prefix of it is credited in full by the router (the full-attention group holds its blocks), and vLLM
    reuses none of it (no Mamba state was kept at its end: the prefill was one step to the fifth block); the whole
    prompt, ending at the kept state, is reused in full. No event says where a state is missing."""
    base = fresh_base()
    first = [base + i for i in range(5 * B)] + [base + 999]
    mamba_worker.engine.prefill(first)
    mamba_worker.sync()
    gaps = [credit_gap(mamba_worker, first[: n * B] + [base + 997]) for n in range(1, 5)]
    assert gaps == [(1, 0), (2, 0), (3, 0), (4, 0)]
    assert credit_gap(mamba_worker, first) == (5, 5)
    assert MAMBA_GAP_CAUSE is Cause.MAMBA_STATE_NOT_REUSABLE and cause_class(MAMBA_GAP_CAUSE) == CACHE_BLIND


def test_the_searched_row_meets_the_finding_and_never_fails_on_it(mamba_worker):
    """The row's search on the Mamba hybrid records gaps (vLLM reusing less than credited) without failing."""
    gaps: list[tuple[int, int]] = []
    assert run_search(hybrid_body(mamba_worker, gaps), sequences(B), 10, seed=1)[1:] == (0, None)
    assert gaps and all(reused < credited for credited, reused in gaps)


def test_the_mamba_row_runs_with_its_control_failing(hybrid_worker):
    hybrid_worker(None)  # the row opens its own engine: the module's is closed first
    path = open_router_path("the relay -> KvRouter path for vLLM's events")
    try:
        row = hybrid.row(path, B, 4, 0, "mamba")
    finally:
        path.close()
    assert (row.prop, row.variant, row.cases, row.status) == ("hybrid", "mamba", 4, "ok")
    assert (row.control["failed"], row.control["cause"]) == (True, "INGEST_STALE")


def _stored(group: int, *hashes: int) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "group_idx": group}


def _removed(group: int, *hashes: int) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "group_idx": group}


def test_the_fold_records_a_removal_of_a_hash_the_full_attention_group_still_holds():
    """The evidence the row names VLLM_BLOCK_COPIES_UNCOUNTED on: a BlockRemoved of a hash whose full-attention copy
    stays (its second copy's, or the window group's). Its negative control: a removal of the last copy is not."""
    live, gone, copies = Counter(), set(), set()
    full_attention_blocks(live, gone, [_stored(0, 1, 2), _stored(1, 1, 2), _stored(0, 1)], copies)
    full_attention_blocks(live, gone, [_removed(1, 2), _removed(0, 1)], copies)
    assert (dict(live), gone, copies) == ({1: 1, 2: 1}, set(), {1, 2})
    live, gone, copies = Counter(), set(), set()
    full_attention_blocks(live, gone, [_stored(0, 1, 2), _removed(0, 1, 2), _removed(1, 1)], copies)
    assert (dict(live), gone, copies) == ({}, {1, 2}, set())


def test_the_control_expects_the_releases_own_cause_where_its_relay_reads_no_group_tags():
    assert reads_group_tags()  # the installed Dynamo (1.6.1) reads them
    assert control_cause(True) is Cause.INGEST_STALE
    assert control_cause(False) is COPIES_CAUSE is Cause.VLLM_BLOCK_COPIES_UNCOUNTED
    assert cause_class(COPIES_CAUSE) == CACHE_BLIND


def test_a_relay_reading_the_tags_and_counting_copies_indexes_the_copies_sequence(worker):
    """The control of the 1.0.2 test below: the sequence that drops a held block on 1.0.2 runs clean on the
    installed relay (1.6.1), after the untag control's own prompts too; untagged, it still fails INGEST_STALE."""
    assert run_search(hybrid_body(worker), st.just(COPIES_SEQUENCE), 3, seed=0)[1:] == (0, None)
    assert run_search(hybrid_body(worker), st.just(CONTROL_SEQUENCE + COPIES_SEQUENCE), 3, seed=0)[1:] == (0, None)
    with controls.on_hop(worker, untag_groups):
        found = run_search(hybrid_body(worker), st.just(CONTROL_SEQUENCE + COPIES_SEQUENCE), 3, seed=0)[2]
    assert found is not None and found.cause is Cause.INGEST_STALE


DRIVE_102 = """
import json
from kvalign.oracles.router_path import RouterPath
from kvalign.verify.props.vllm import hybrid
path = RouterPath()
try:
    row = hybrid.row(path, 16, 5, 0)
finally:
    path.close()
print("RESULT" + json.dumps({"tags": hybrid.reads_group_tags(), "status": row.status, "detail": row.detail,
                             "control": row.control}))
"""


@pytest.mark.matrix
@pytest.mark.nightly
@pytest.mark.timeout(1800)
def test_on_dynamo_1_0_2_the_row_finds_the_uncounted_copies_and_its_control_fails_on_them(official_vllm_wheels):
    """Dynamo 1.0.2 x vLLM 0.33.0 (official wheel): 1.0.2's relay reads no group tags and its index keeps one entry
    per hash, so a block vLLM's full-attention group holds twice is dropped at the first BlockRemoved of it, with
    every store chained below: the row's finding, VLLM_BLOCK_COPIES_UNCOUNTED; its control (untag_groups, which
    changes nothing there) fails with that cause. The control for this test is the one above: 1.6.1 runs the same
    sequence clean."""
    from kvalign.releases.release_env import child_env, python_for
    from kvalign.releases.vllm_env import RELEASE_ENV
    from kvalign.verify.report import matrix_vllm
    from kvalign.verify.report.matrix import ensure_release

    matrix_vllm.probe("0.33.0")  # installs the official wheel once
    env = {**child_env(), RELEASE_ENV: "vllm==0.33.0", "DYN_LOG": "error",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([python_for([ensure_release("dynamo", "1.0.2")]), "-c", DRIVE_102], capture_output=True,
                         text=True, env=env, timeout=900, cwd=ROOT)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT"):])
    assert (got["tags"], got["status"]) == (False, "finding"), got
    assert "after a BlockRemoved of another copy of its hash" in got["detail"], got
    assert (got["control"]["failed"], got["control"]["cause"]) == (True, "VLLM_BLOCK_COPIES_UNCOUNTED"), got
