"""What Dynamo 1.6.1's relay keys a vLLM block by: kvalign's prediction from vLLM's ``BlockStored``.

vLLM's event carries its own block hashes (64-bit ints by default), the block's ``token_ids``,
``lora_name`` and ``extra_keys`` (one entry per block: the LoRA name, multimodal ``(id, offset)``
pairs, the ``cache_salt`` on a request's first block). The relay does not trust vLLM's hashes as keys:
it re-hashes each block's ``token_ids`` with the router's own hasher
(``compute_block_hash_for_seq(tokens, block_size, lora_name=..., cache_namespace=...)``) and keeps
vLLM's hashes only as node ids (parents, removals). Its namespace comes from ``extra_keys`` *only*
when a string there starts with ``dynamo-cache-salt:`` (the prefix ``dynamo/vllm/handlers.py``
puts on a request's ``nvext.cache_salt`` before vLLM sees it); an event without one inherits its
parent block's namespace. A salt that reaches vLLM any other way salts vLLM's hashes but not the
router's keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvalign.model.hashing import compute_block_hash_for_seq

#: The prefix ``dynamo.vllm`` 1.6.1 puts on a request's cache salt (``handlers._DYNAMO_CACHE_SALT_PREFIX``),
#: and the one the relay looks for in ``extra_keys``.
DYNAMO_SALT_PREFIX = "dynamo-cache-salt:"

SaltRule = Callable[[Mapping[str, Any]], "str | None"]


def dynamo_salt(cache_salt: str) -> str:
    """The salt ``dynamo.vllm`` hands vLLM for a request's ``nvext.cache_salt``."""
    return f"{DYNAMO_SALT_PREFIX}{cache_salt}"


def relay_salt(event: Mapping[str, Any]) -> str | None:
    """The namespace the relay recovers from one ``BlockStored``'s ``extra_keys``: the first string
    starting with :data:`DYNAMO_SALT_PREFIX`, prefix removed; None when there is none."""
    for entry in event.get("extra_keys") or ():
        for value in entry or ():
            if isinstance(value, str) and value.startswith(DYNAMO_SALT_PREFIX):
                return value[len(DYNAMO_SALT_PREFIX):]
    return None


class VllmRelayModel:
    """The router local hash kvalign predicts for each block of a vLLM event stream, by vLLM's hash.

    ``salt_rule`` and ``hasher`` are the relay's rules; the negative controls swap one of them."""

    def __init__(self, block_size: int, *, salt_rule: SaltRule = relay_salt,
                 hasher: Callable[..., list[int]] = compute_block_hash_for_seq) -> None:
        self.block_size = block_size
        self.salt_rule = salt_rule
        self.hasher = hasher
        #: vLLM block hash -> router local hash, for every block stored and not removed
        self.keys: dict[int, int] = {}
        self._namespace: dict[int, str | None] = {}

    def apply(self, event: Mapping[str, Any]) -> None:
        """Fold one of vLLM's events (a map: ``type`` and its fields) into the prediction."""
        kind = event.get("type")
        if kind == "BlockStored":
            hashes = [int(h) for h in event["block_hashes"]]
            parent = event.get("parent_block_hash")
            namespace = self.salt_rule(event)
            if namespace is None and parent is not None:
                namespace = self._namespace.get(int(parent))
            local = self.hasher(list(event["token_ids"]), self.block_size, lora_name=event.get("lora_name"),
                                cache_namespace=namespace)
            for engine_hash, key in zip(hashes, local):
                self.keys[engine_hash] = key
                self._namespace[engine_hash] = namespace
        elif kind == "BlockRemoved":
            for h in event["block_hashes"]:
                self.keys.pop(int(h), None)
                self._namespace.pop(int(h), None)
        elif kind == "AllBlocksCleared":
            self.keys.clear()
            self._namespace.clear()
        else:
            raise ValueError(f"unknown vLLM event type {kind!r}")
