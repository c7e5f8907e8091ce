"""hash on vLLM: the key the real relay gives each of vLLM's blocks (its re-hash of ``token_ids``) is
the key kvalign's model predicts from vLLM's own event (:class:`kvalign.model.vllm_keys.VllmRelayModel`).

vLLM's real ``KVCacheManager`` serves prompts with every tenant shape (none, a LoRA, a salt with
``dynamo.vllm``'s prefix, a continuation inheriting that salt, a raw salt); its real publisher sends
the events through Dynamo's real relay into a real ``KvRouter``, whose index dump gives, per vLLM
block hash, the router's local hash. Negative controls: the model with the salt taken from
``extra_keys`` whatever its prefix (as vLLM itself salts), and with the LoRA name left out; each must
miss exactly the blocks that rule decides.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from router_paths import open_router_path
from vllm_paths import open_vllm_worker

from kvalign.model.hashing import compute_block_hash_for_seq
from kvalign.model.vllm_keys import VllmRelayModel, dynamo_salt, relay_salt

B = 16


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[list[dict[str, Any]], dict[int, int]]]:
    """vLLM's events for one prompt per tenant shape, and the router's (vLLM hash -> local hash)."""
    path = open_router_path("the relay -> KvRouter path for vLLM's events")
    worker = None
    try:
        worker = open_vllm_worker(path, B, 64)
        base = list(range(1000, 1000 + 3 * B)) + [7] * 5
        prompts = [
            ({}, base),
            ({"lora_name": "adapterA"}, list(range(2000, 2000 + 2 * B)) + [1]),
            ({"cache_salt": dynamo_salt("tenant-y")}, list(range(3000, 3000 + 2 * B)) + [1]),
            ({"cache_salt": dynamo_salt("tenant-y")}, list(range(3000, 3000 + 4 * B)) + [1]),  # inherits
            ({"cache_salt": "tenant-x"}, base),  # no prefix: vLLM salts, the relay does not
        ]
        events: list[dict[str, Any]] = []
        for kw, tokens in prompts:
            worker.engine.prefill(tokens, **kw)
            events += worker.sync()
        yield events, {engine: local for _parent, engine, local in worker.dump()}
    finally:
        if worker is not None:
            worker.close()
        path.close()


def _model(events: list[dict[str, Any]], **kw: Any) -> dict[int, int]:
    model = VllmRelayModel(B, **kw)
    for ev in events:
        model.apply(ev)
    return model.keys


def _mismatched(predicted: dict[int, int], router: dict[int, int]) -> set[int]:
    """vLLM hashes whose predicted key the router does not hold: another key under that hash, or a key
    no indexed block has (the router's dump lists one vLLM hash per tree node, so a block whose key
    and parent equal an indexed block's is that node), plus indexed hashes the model never saw."""
    keys = set(router.values())
    return ({h for h, k in predicted.items() if router.get(h, k) != k or k not in keys}
            | (router.keys() - predicted.keys()))


def test_router_rehash_of_vllm_blocks_equals_the_model(served):
    events, router = served
    predicted = _model(events)
    assert len(predicted) == sum(len(e["block_hashes"]) for e in events if e["type"] == "BlockStored") == 12
    assert len(router) == 9  # the raw-salted prompt's 3 blocks are keyed as the unsalted prompt's: one node each
    assert _mismatched(predicted, router) == set()


def test_the_continuation_of_a_salted_prefix_is_keyed_in_its_parents_namespace(served):
    events, router = served
    cont = next(e for e in events if e["type"] == "BlockStored" and e["parent_block_hash"] is not None)
    assert not any(cont["extra_keys"])  # vLLM names the salt on a request's first block only
    unsalted = compute_block_hash_for_seq(cont["token_ids"], B)
    assert [router[h] for h in cont["block_hashes"]] != unsalted
    assert [router[h] for h in cont["block_hashes"]] == compute_block_hash_for_seq(
        cont["token_ids"], B, cache_namespace="tenant-y")


def _any_salt(event: dict[str, Any]) -> str | None:
    """A relay that takes a request's salt whatever its prefix: vLLM's own rule (the first block's extra
    keys hold the LoRA name, then the salt); Dynamo's prefix still removed."""
    first = [k for k in ((event.get("extra_keys") or [None])[0] or []) if k != event.get("lora_name")]
    return relay_salt(event) or (first[-1] if first and isinstance(first[-1], str) else None)


def test_negative_control_a_relay_taking_any_salt_misses_the_raw_salt_blocks(served):
    events, router = served
    raw = next(e for e in events if e["type"] == "BlockStored" and (e["extra_keys"] or [None])[0] == ["tenant-x"])
    assert _mismatched(_model(events, salt_rule=_any_salt), router) == set(raw["block_hashes"])


def test_negative_control_a_model_without_lora_misses_the_lora_blocks(served):
    events, router = served

    def lora_blind(tokens: Any, block_size: int, **kw: Any) -> list[int]:
        kw.pop("lora_name", None)
        return compute_block_hash_for_seq(tokens, block_size, **kw)

    predicted = _model(events, hasher=lora_blind)
    lora = next(e for e in events if e["type"] == "BlockStored" and e["lora_name"])
    assert _mismatched(predicted, router) == set(lora["block_hashes"])
