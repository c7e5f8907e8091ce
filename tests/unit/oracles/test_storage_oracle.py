"""SGLang's real HiCache storage tier (``file`` backend) in-process on CPU: a round trip, its keys, its events.

Held to SGLang's own functions: the files the backend wrote are ``get_storage_hash_str``'s keys of the
cached pages, a refill publishes host-medium stores, and another tenant's keys find nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

PROMPT = list(range(1, 18))


def _shape(events: list[Any]) -> list[tuple[str, str, int]]:
    return [(type(e).__name__, getattr(e.medium, "value", e.medium), len(e.block_hashes)) for e in events]


@pytest.fixture
def engine(sglang_available: str) -> Iterator[Any]:
    from kvalign.oracles.base import OracleUnavailable
    from kvalign.oracles.storage import StorageEngine

    try:
        e = StorageEngine(4, eagle=False)
    except OracleUnavailable as exc:
        pytest.skip(str(exc))
    yield e
    e.close()


def test_round_trip_through_storage(engine: Any) -> None:
    engine.insert(PROMPT)
    assert engine.pump(lambda: len(engine.stored_files()) == 4) and engine.pump()
    assert _shape(engine.take_raw_events()) == [("BlockStored", "GPU", 4), ("BlockStored", "CPU_PINNED", 4)]
    assert engine.stored_files() == sorted(engine.storage_keys(PROMPT))
    engine.evict(1 << 16)
    engine.evict_host(1 << 16)
    assert _shape(engine.take_raw_events()) == [("BlockRemoved", "GPU", 4), ("BlockRemoved", "CPU_PINNED", 4)]
    held = engine.tiers(PROMPT)
    assert (held.device, held.host, held.storage) == (0, 0, 4)
    assert engine.refill(PROMPT) == 16  # 16 of 17 tokens: the scheduler's cap leaves the last one to compute
    assert _shape(engine.take_raw_events()) == [("BlockStored", "CPU_PINNED", 4)]
    assert engine.tiers(PROMPT).host == 4


@pytest.mark.parametrize("tenant", [("tenant-b", None), (None, "salt-b"), ("tenant-b", "salt-b")])
def test_another_tenant_finds_nothing_in_storage(engine: Any, tenant: tuple[str | None, str | None]) -> None:
    engine.insert(PROMPT, "tenant-a", "salt-a")
    assert engine.pump(lambda: len(engine.stored_files()) == 4) and engine.pump()
    engine.evict(1 << 16)
    engine.evict_host(1 << 16)
    assert engine.storage_keys(PROMPT, *tenant) != engine.storage_keys(PROMPT, "tenant-a", "salt-a")
    assert engine.tiers(PROMPT, *tenant).storage == 0
    assert engine.refill(PROMPT, *tenant) == 0
    assert engine.refill(PROMPT, "tenant-a", "salt-a") == 16  # the same tokens of tenant A do refill


@pytest.mark.slow  # fast tier: the negative controls and the fixed counterexamples
def test_a_second_engine_starts_after_the_first_closed(engine: Any) -> None:
    """Each example builds its own engine: the first one's pinned host ranges must be given back."""
    from kvalign.oracles.storage import StorageEngine

    engine.close()
    for _ in range(2):
        StorageEngine(4, eagle=False).close()
