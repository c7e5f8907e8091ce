"""A hybrid model's Mamba group on vLLM's real cache, in the vLLM interpreter (:mod:`.vllm_cache` uses it).

vLLM 0.32 caches a Mamba group's state in ``mamba_cache_mode='align'`` by default for a Mamba model with prefix
caching on (``MambaModelConfig.verify_and_update_config`` turns ``'none'`` into ``'align'``): the state is kept only
at the end of a scheduler step that ends at a block boundary, so *where the scheduler splits a prefill* decides which
prefixes have a state to reuse. The split is vLLM's own: ``Scheduler._mamba_block_aligned_split``, a method that
reads nothing of the scheduler but the settings its ``__init__`` derives from the config (listed in
:func:`split_settings`). It is called here on a stand-in holding those settings, so a prefill runs the steps a real
scheduler gives one request alone in its batch (the budget: the default ``SchedulerConfig``'s
``max_num_batched_tokens``, 2048 tokens).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

#: the mode vLLM 0.32 gives a Mamba model with prefix caching on (``vllm/model_executor/models/config.py``)
MAMBA_CACHE_MODE = "align"
#: the vLLM releases (major, minor) whose ``Scheduler.__init__`` :func:`split_settings` mirrors, read in 0.32.0's source.
#: Others derive other settings: 0.33.0's split reads ``num_hash_lookahead_tokens`` (given here as 0, but 0.33.0's other
#: settings are not compared), and under 0.31.0's the Mamba row's control sequence is no counterexample (its control
#: did not fail: the row would prove nothing). There a Mamba cache does not start, so the row is ``n/a`` naming this.
DRIVEN = ((0, 32),)


def check_driven(version: tuple[object, ...]) -> None:
    """Refuse (``ValueError``) a vLLM release whose scheduler settings :func:`split_settings` does not mirror."""
    if tuple(version[:2]) not in DRIVEN:
        raise ValueError(f"kvalign's Mamba scheduler stand-in mirrors vLLM {', '.join('.'.join(map(str, d)) for d in DRIVEN)}'s "
                         f"Scheduler settings, not vLLM {'.'.join(map(str, version[:3]))}'s")


def mamba_spec(v: types.SimpleNamespace, block_size: int) -> Any:
    """A Mamba group's spec, one block per ``block_size`` tokens as vLLM sets it under prefix caching
    (``mamba_block_size = block_size``); its state's shape is irrelevant to the cache's keys and hits."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=block_size, shapes=((1,),), dtypes=(v.torch.float32,),
                     mamba_cache_mode=MAMBA_CACHE_MODE)


def split_settings(spec: Any, block_size: int, max_model_len: int) -> types.SimpleNamespace:
    """What ``Scheduler.__init__`` derives for a full-attention + one Mamba group in ``'align'`` mode with the
    hash block size equal to the block size, no speculative decoding and vLLM's default ``SchedulerConfig``: the
    attributes ``_mamba_block_aligned_split`` reads, each as the scheduler sets it."""
    from vllm.config.scheduler import SchedulerConfig

    config = SchedulerConfig(max_model_len=max_model_len, is_encoder_decoder=False)
    hash_block_size = block_size
    return types.SimpleNamespace(
        block_size=block_size, cache_config=types.SimpleNamespace(block_size=block_size),
        hash_block_size=hash_block_size,
        # need_mamba_block_aligned_split and hash_block_size < block_size (never: equal here)
        mamba_partial_cache_hit=hash_block_size < block_size,
        mamba_shared_prefix_checkpoint=False,  # needs mamba_partial_cache_hit
        mamba_prefill_checkpoint_alignment=spec.prefill_checkpoint_alignment,
        mamba_has_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks > 0,
        use_eagle_block_drop=False,  # no speculative config
        num_hash_lookahead_tokens=0,  # VllmConfig's, 0 with no speculative config (vLLM 0.33.0's split reads it)
        max_num_scheduled_tokens=config.max_num_scheduled_tokens or config.max_num_batched_tokens,
        scheduler_config=config)


def aligned_split(spec: Any, block_size: int, max_model_len: int) -> Callable[[Any, int, int], int]:
    """``split(request, num_new_tokens, num_new_local_computed_tokens)``: vLLM's scheduler's block-aligned clip
    of one prefill step (its ``num_new_tokens`` capped by the step's token budget first, as the scheduler does)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.version import __version_tuple__

    check_driven(__version_tuple__)
    settings = split_settings(spec, block_size, max_model_len)

    def split(request: Any, num_new_tokens: int, local_hit: int) -> int:
        n = min(num_new_tokens, settings.max_num_scheduled_tokens)
        return int(Scheduler._mamba_block_aligned_split(settings, request, n, local_hit))

    return split
