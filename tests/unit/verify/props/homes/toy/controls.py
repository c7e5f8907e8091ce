"""The toy property's negative control: ``check --router-hash kvalign.verify.props.toy.controls:length_salted``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvalign.model.hashing import U64_MASK


def length_salted(tokens: Sequence[int], kv_block_size: int, block_mm_infos: Any = None, lora_name: str | None = None,
                  is_eagle: bool | None = None, cache_namespace: str | None = None) -> list[int]:
    """The real router hasher with the prompt's length folded into every block: a prefix's blocks stop matching."""
    from kvalign.oracles.dynamo import load_router_hasher

    real = load_router_hasher()(tokens, kv_block_size, block_mm_infos, lora_name, is_eagle, cache_namespace)
    return [(int(h) ^ len(tokens)) & U64_MASK for h in real]
