"""Router hashers that break the worker process calling them, for ``check --jobs``'s failure tests
(``--router-hash broken_hashers:raises`` with this directory on ``PYTHONPATH``): one raises an error
that is no mismatch (a bug in the harness or an oracle), one kills its process on an EAGLE query."""

from __future__ import annotations

import os
import signal
from typing import Any


def raises(tokens: Any, kv_block_size: int, block_mm_infos: Any = None, lora_name: Any = None, is_eagle: Any = None,
           cache_namespace: Any = None) -> list[int]:
    if is_eagle:
        raise RuntimeError("a hasher bug")
    from kvalign.model.hashing import compute_block_hash_for_seq

    return compute_block_hash_for_seq(tokens, kv_block_size, block_mm_infos, lora_name, is_eagle, cache_namespace)


def dies(tokens: Any, kv_block_size: int, block_mm_infos: Any = None, lora_name: Any = None, is_eagle: Any = None,
         cache_namespace: Any = None) -> list[int]:
    if is_eagle:
        os.kill(os.getpid(), signal.SIGKILL)
    from kvalign.model.hashing import compute_block_hash_for_seq

    return compute_block_hash_for_seq(tokens, kv_block_size, block_mm_infos, lora_name, is_eagle, cache_namespace)
