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

from collections.abc import Callable, Mapping, Sequence
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


def dynamo_mm_identifier(mm_hash: int) -> str:
    """The image identifier ``dynamo.vllm`` 1.6.1 hands vLLM for the frontend's routing hash ``mm_hash``
    (``multimodal_utils/request_processor.py``, ``mark_forwarded_mm_hashes_for_routing``): its 16 hex
    digits, then 48 zeros. vLLM keys the image's blocks by it and publishes it in ``extra_keys`` as
    ``(identifier, offset)``; the relay reads a 64-character key back as a routing hash only in this form."""
    return f"{mm_hash & 0xFFFF_FFFF_FFFF_FFFF:016x}" + "0" * 48


def block_mm_infos(num_tokens: int, block_size: int,
                   images: Sequence[tuple[int, int, int]]) -> list[dict[str, Any] | None] | None:
    """Per full block of a prompt, the image routing hashes the router keys it with: ``images`` are
    ``(mm_hash, offset, length)``, and a block carries every image whose placeholder range it overlaps (the
    blocks vLLM's ``_gen_mm_extra_hash_keys`` puts the image in). The relay builds this from vLLM's
    ``extra_keys`` (``offsets`` left empty: the router's hash reads ``mm_hash`` only); kvalign queries the
    router with the same shape, as the frontend's ``block_mm_infos``. None for a prompt without images."""
    if not images:
        return None
    out: list[dict[str, Any] | None] = []
    for i in range(num_tokens // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        objs = [{"mm_hash": h, "offsets": []} for h, off, n in sorted(images, key=lambda im: im[1])
                if off < hi and off + n > lo]
        out.append({"mm_objects": objs} if objs else None)
    return out
