"""vLLM behind Dynamo's KV router (``check --engine vllm``): the hash, pages, ingest, tenants, mm, tiers and
hybrid rows on vLLM's real ``KVCacheManager`` (in vLLM's own environment, :mod:`kvalign.releases.vllm_env`), its real
``ZmqEventPublisher``, and Dynamo's real relay and ``KvRouter`` wired as ``dynamo.vllm`` wires them.

One property, ``vllm``, whose one job starts one vLLM engine and prints its rows under the SGLang rows'
names (``hash``, ``pages``, ``ingest``, ``tenants``), each with its negative control, then the rows of their own
modules: ``mm`` (image prompts, :mod:`.mm`) on the same engine, ``tiers`` (the CPU offload tier, :mod:`.tiers`)
and ``hybrid`` (full attention + sliding window, :mod:`.hybrid`) each on an engine of its own, ``blocks`` (per block
size, :mod:`.blocks`), ``hashes int`` and ``events`` (vLLM's map encoding, :mod:`.encodings`). It is the default of
``check --engine vllm`` (SGLang's ``check`` never runs it); the opt-in ``hashes bytes`` row is a property of its own
(:mod:`kvalign.verify.props.vllm_bytes`, ``--all``). Importing this package imports neither vLLM, Dynamo nor SGLang.
"""

from __future__ import annotations

from typing import Any

from kvalign.verify.engine.property import Budget, Options, SetUpOnceProperty
from kvalign.verify.engine.rows import RowResult

BUDGET = Budget("vllm", 50, "generated cases per vLLM row (check --engine vllm; default 50)")


def _rows(systems: Any, modes: tuple[str, ...], opts: Options) -> list[RowResult]:
    from kvalign.verify.props.vllm.rows import vllm_rows

    return vllm_rows(systems, modes, opts)


def header(dynamo: str, examples: int, page_size: int | None) -> list[str]:
    """``check --engine vllm``'s header lines (the engine's version is the pinned one its environment runs)."""
    from kvalign.releases.vllm_env import selected
    from kvalign.verify.props.vllm.running import BLOCK_SIZE, NUM_BLOCKS

    dist, version = selected()
    return [f"kvalign check: vLLM {dist} {version} (KVCacheManager) x Dynamo relay + KvRouter {dynamo}",
            f"  {examples} examples per row (--vllm-examples); block size "
            f"{page_size or BLOCK_SIZE}; {NUM_BLOCKS} blocks"]


PROPERTY = SetUpOnceProperty("vllm", modes=("plain",), default=True, surface="vLLM workers", engine="vllm", events="own", budget=BUDGET, cost=60.0,
                             rows=_rows, variants=())
