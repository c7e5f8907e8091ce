"""The one small interface every real system sits behind.

kvalign compares three parties: a *router hasher* (Dynamo's ``compute_block_hash_for_seq`` or a
user's patched build), a *router index* (the radix tree the router matches prompts against), and
an *engine cache* (SGLang's radix cache, which emits the KV events). Keeping each behind a
protocol lets ``kvalign check`` swap in a user's router build without touching the properties.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvalign.errors import OracleUnavailable
from kvalign.model.events import KVEvent

if TYPE_CHECKING:
    from kvalign.model.relay import RouterEvent


__all__ = ["EngineCache", "OracleUnavailable", "RouterHasher", "RouterIndex"]


class RouterHasher(Protocol):
    """Anything with ``dynamo._core.compute_block_hash_for_seq``'s signature."""

    def __call__(
        self,
        tokens: Sequence[int],
        kv_block_size: int,
        block_mm_infos: Sequence[Mapping[str, Any] | None] | None = None,
        lora_name: str | None = None,
        is_eagle: bool | None = None,
        cache_namespace: str | None = None,
    ) -> list[int]: ...


class RouterIndex(Protocol):
    """A prefix index over router local hashes, fed with router-side events."""

    def apply(self, worker_id: int, event: "RouterEvent") -> None: ...

    def overlap(self, local_hashes: Sequence[int]) -> dict[int, int]: ...


class EngineCache(Protocol):
    """An engine prefix cache that emits KV events (SGLang's radix cache)."""

    page_size: int
    eagle: bool

    def insert(self, tokens: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None) -> int: ...

    def match(self, tokens: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None) -> int: ...

    def evict(self, num_tokens: int) -> int: ...

    def take_events(self) -> list[KVEvent]: ...
