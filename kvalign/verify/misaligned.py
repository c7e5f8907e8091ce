"""Deliberately misaligned router hashers: the negative controls.

A property that cannot fail proves nothing. Each hasher here reproduces one real class of
router regression on top of the *real* router binding (kvalign's reference when Dynamo is not
installed), so the unit tests — and a user, via ``kvalign check --router-hash
kvalign.verify.misaligned:ignore_eagle`` — can watch every property catch it.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from kvalign.oracles.base import OracleUnavailable, RouterHasher


@cache
def _real() -> RouterHasher:
    from kvalign.oracles.dynamo import load_router_hasher

    try:
        return load_router_hasher()
    except OracleUnavailable:
        from kvalign.model.hashing import compute_block_hash_for_seq

        return compute_block_hash_for_seq


def ignore_eagle(tokens: Sequence[int], kv_block_size: int, block_mm_infos: Any = None, lora_name: str | None = None,
                 is_eagle: bool | None = None, cache_namespace: str | None = None) -> list[int]:
    """Dynamo #10982-style: the EAGLE flag never reaches the hasher (always B-token windows)."""
    return _real()(tokens, kv_block_size, block_mm_infos, lora_name, False, cache_namespace)


def flip_eagle(tokens: Sequence[int], kv_block_size: int, block_mm_infos: Any = None, lora_name: str | None = None,
               is_eagle: bool | None = None, cache_namespace: str | None = None) -> list[int]:
    """The flag inverted both ways: plain prompts get EAGLE windows and EAGLE prompts plain ones."""
    return _real()(tokens, kv_block_size, block_mm_infos, lora_name, not is_eagle, cache_namespace)


def eagle_b_window(tokens: Sequence[int], kv_block_size: int, block_mm_infos: Any = None, lora_name: str | None = None,
                   is_eagle: bool | None = None, cache_namespace: str | None = None) -> list[int]:
    """EAGLE block count right (floor((N-1)/B)) but B-token windows instead of B+1."""
    if not is_eagle:
        return _real()(tokens, kv_block_size, block_mm_infos, lora_name, False, cache_namespace)
    n = max(len(tokens) - 1, 0) // kv_block_size
    return _real()(list(tokens)[: n * kv_block_size], kv_block_size, block_mm_infos, lora_name, False, cache_namespace)


def drop_lora(tokens: Sequence[int], kv_block_size: int, block_mm_infos: Any = None, lora_name: str | None = None,
              is_eagle: bool | None = None, cache_namespace: str | None = None) -> list[int]:
    """The LoRA name never reaches the seed (tenants' adapters share blocks)."""
    return _real()(tokens, kv_block_size, block_mm_infos, None, is_eagle, cache_namespace)


def drop_namespace(tokens: Sequence[int], kv_block_size: int, block_mm_infos: Any = None, lora_name: str | None = None,
                   is_eagle: bool | None = None, cache_namespace: str | None = None) -> list[int]:
    """The cache namespace (cache_salt) never reaches the seed (tenants share blocks)."""
    return _real()(tokens, kv_block_size, block_mm_infos, lora_name, is_eagle, None)


ALL: dict[str, RouterHasher] = {
    "ignore_eagle": ignore_eagle,
    "flip_eagle": flip_eagle,
    "eagle_b_window": eagle_b_window,
    "drop_lora": drop_lora,
    "drop_namespace": drop_namespace,
}
