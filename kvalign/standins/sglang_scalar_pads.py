"""SGLang 0.5.21's scalar image pad value, loaded on 0.5.23: the aligned baseline of the ``mm`` controls.

Up to 0.5.21 SGLang fills every placeholder token of an image with one value,
``MM_PAD_SHIFT_VALUE + (hash % 2**30)`` (``schedule_batch._compute_pad_value``), which is the
formula Dynamo 1.6.1's frontend fills its routing sequence with. 0.5.23 derives four 62-bit
sentinels from a SHA-256 of the hash instead (``_compute_pad_values``), which no u32 router token
can hold: on the pinned pair every image page misaligns (``MM_PAD_WIDTH``), and a negative control
run there would only show that. With this stand-in the pinned pair keys images as the shipped pair
(Dynamo 1.6.1 with its ``ai-dynamo[sglang]`` pin, SGLang 0.5.21) does, so each control's own
cause is what fails.

Only the pad rule changes: 0.5.23's ``set_hash`` / ``set_identity`` still run and call the module's
``_compute_pad_values``, which this patches for the ``with`` block. Held equal to 0.5.21's own
``_compute_pad_value`` by ``tests/unit/standins/test_sglang_scalar_pads.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvalign.errors import OracleUnavailable
from kvalign.model.mm_keys import MM_PAD_SHIFT_VALUE

#: Set to "1" in a real-engine worker's environment (the live layer's aligned control): the CPU
#: engine stand-in's import hook (:mod:`kvalign.standins.sglang_cpu.hooks`) then installs the rule in
#: the worker and in SGLang's scheduler children as ``schedule_batch`` loads.
ENABLE_ENV = "KVALIGN_MM_SCALAR_PADS"
#: The release whose pad rule this is, and the one it is loaded on.
RULE_OF = "0.5.21"
LOADED_ON = "0.5.23"


def scalar_pad_value(item_hash: int) -> int:
    """SGLang 0.5.21's ``_compute_pad_value``: one value per image, below 2^31."""
    return MM_PAD_SHIFT_VALUE + (item_hash % (1 << 30))


def _scalar_pad_values(identity: bytes) -> tuple[int, ...]:
    # 0.5.23 calls this with the item hash as 8 big-endian bytes (set_hash), or with a 32-byte
    # digest whose first 8 bytes are the item hash (set_identity): either way, the item hash.
    return (scalar_pad_value(int.from_bytes(identity[:8], byteorder="big")),)


@contextmanager
def scalar_pads() -> Iterator[None]:
    """Key images with 0.5.21's scalar pad value for the ``with`` block (SGLang 0.5.23 only)."""
    module = _schedule_batch()
    original = module._compute_pad_values
    module._compute_pad_values = _scalar_pad_values
    try:
        yield
    finally:
        module._compute_pad_values = original


def install_in_module() -> None:
    """Key images with 0.5.21's scalar pad value for the rest of the process (a worker's import hook)."""
    _schedule_batch()._compute_pad_values = _scalar_pad_values


def _schedule_batch() -> Any:
    import importlib.metadata

    version = importlib.metadata.version("sglang")
    if version != LOADED_ON:
        raise OracleUnavailable(f"kvalign's scalar-pad stand-in is pinned to SGLang {LOADED_ON}, not {version}")
    from sglang.srt.managers import schedule_batch

    if not hasattr(schedule_batch, "_compute_pad_values"):
        raise OracleUnavailable(f"SGLang {version} has no _compute_pad_values to stand in for")
    return schedule_batch
