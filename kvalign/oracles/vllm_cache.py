"""vLLM's real prefix cache, in the vLLM interpreter: ``KVCacheManager`` with caching and KV events on.

This module imports vLLM, so it runs only in vLLM's own environment
(:mod:`kvalign.releases.vllm_env`), behind :mod:`kvalign.oracles.vllm_child`; kvalign's process
reaches it through :class:`kvalign.oracles.vllm.VllmEngine`. Everything that decides a key or an
event is vLLM's code: the request block hasher the engine core builds (``get_request_block_hasher``
with the configured ``--prefix-caching-hash-algo``, after ``init_none_hash``), the manager's prefix
lookup (``get_computed_blocks``), its allocation (which caches the prompt's full blocks and publishes
``BlockStored``), its free queue and LRU eviction (``BlockRemoved``), and ``ZmqEventPublisher``. The
only kvalign code is the sequence a scheduler runs for one prefill: look up, allocate, finish, free.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import types
from collections.abc import Sequence
from typing import Any


def _import_vllm() -> types.SimpleNamespace:
    """vLLM's prefix-cache modules, behind the torchvision shim SGLang's oracle uses.

    PyPI's torchvision is a CUDA build whose two op-registration modules fail beside torch+cpu;
    pre-seeding them lets the rest of vLLM's import chain (``v1.request`` pulls multimodal code) load."""
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))
    import torch
    from vllm.config.cache import CacheConfig
    from vllm.distributed import kv_events
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.request import Request

    return types.SimpleNamespace(
        torch=torch, CacheConfig=CacheConfig, kv_events=kv_events, LoRARequest=LoRARequest, SamplingParams=SamplingParams,
        get_hash_fn_by_name=get_hash_fn_by_name, kv_cache_utils=kv_cache_utils, KVCacheManager=KVCacheManager,
        FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec,
        SlidingWindowSpec=SlidingWindowSpec, MultiModalFeatureSpec=MultiModalFeatureSpec,
        PlaceholderRange=PlaceholderRange, Request=Request)


def default_hash_algo(v: types.SimpleNamespace) -> str:
    """``--prefix-caching-hash-algo``'s default, read from vLLM's ``CacheConfig``."""
    field = {f.name: f for f in dataclasses.fields(v.CacheConfig)}["prefix_caching_hash_algo"]
    return str(field.default)


#: One image of a request: ``(identifier, offset, length)``: vLLM's ``MultiModalFeatureSpec.identifier`` and
#: its placeholder range in the prompt (``PlaceholderRange``)
Image = Sequence[Any]


class VllmCache:
    """One engine's KV cache: ``num_blocks`` blocks of ``block_size`` tokens in one full-attention group, or
    a hybrid model's two: full attention (group 0) and sliding window (``sliding_window``) or Mamba (``mamba``)
    (group 1)."""

    def __init__(self, block_size: int, num_blocks: int, *, endpoint: str | None = None,
                 hash_algo: str | None = None, max_model_len: int = 1 << 16, sliding_window: int | None = None,
                 mamba: bool = False, offload: dict[str, int] | None = None, dp_rank: int = 0) -> None:
        """``endpoint``: where vLLM's ``ZmqEventPublisher`` connects (the relay's side of a loopback hop);
        None publishes nothing. ``sliding_window``: tokens of a second, sliding-window group's window (vLLM's
        ``HybridKVCacheCoordinator`` then manages both groups in one block pool). ``mamba``: a second, Mamba group
        in vLLM's default mode for it, whose prefills run in the steps vLLM's scheduler splits them into
        (:mod:`kvalign.oracles.vllm_mamba`). ``offload``: a CPU tier behind
        the cache (:class:`~kvalign.oracles.vllm_offload.CpuOffload`'s ``blocks_per_chunk`` and ``num_chunks``).
        ``dp_rank``: the data-parallel rank its batches carry (``EventBatch.data_parallel_rank``; the publisher
        itself is rank 0's, whose endpoint vLLM does not offset)."""
        self.v = v = _import_vllm()
        self.block_size = block_size
        self.hash_algo = hash_algo or default_hash_algo(v)
        hash_fn = v.get_hash_fn_by_name(self.hash_algo)
        v.kv_cache_utils.init_none_hash(hash_fn)
        self._hasher = v.kv_cache_utils.get_request_block_hasher(block_size, hash_fn)
        spec = v.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=v.torch.float32)
        groups = [v.KVCacheGroupSpec(["layer.0"], spec)]
        if sliding_window is not None:
            groups.append(v.KVCacheGroupSpec(["layer.1"], v.SlidingWindowSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, dtype=v.torch.float32,
                sliding_window=sliding_window)))
        if sliding_window is not None and mamba:
            raise ValueError("a hybrid cache here has one second group: sliding_window or mamba, not both")
        #: a Mamba group's prefill split (vLLM's scheduler's rule), None without one: a prefill is one step
        self._split = None
        if mamba:
            from kvalign.oracles.vllm_mamba import aligned_split, mamba_spec

            groups.append(v.KVCacheGroupSpec(["layer.1"], mamba_spec(v, block_size)))
            self._split = aligned_split(groups[1].kv_cache_spec, block_size, max_model_len)
        config = v.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.manager = v.KVCacheManager(config, max_model_len=max_model_len, scheduler_block_size=block_size,
                                        hash_block_size=block_size, enable_caching=True,
                                        enable_kv_cache_events=True)
        self._publisher = None if endpoint is None else v.kv_events.ZmqEventPublisher(
            data_parallel_rank=0, endpoint=endpoint, topic="")
        self._ids = 0
        self._dp_rank = dp_rank
        self.offload = None
        if offload is not None:
            from kvalign.oracles.vllm_offload import CpuOffload

            self.offload = CpuOffload(groups[0], block_size, **offload)

    def _request(self, tokens: Sequence[int], lora_name: str | None, cache_salt: str | None,
                 mm: Sequence[Image] | None = None) -> Any:
        self._ids += 1
        params = self.v.SamplingParams(max_tokens=1)
        lora = (None if lora_name is None else
                self.v.LoRARequest(lora_name=lora_name, lora_int_id=1 + sum(map(ord, lora_name)),
                                   lora_path=f"/kvalign/lora/{lora_name}"))
        # images as vLLM's input processor hands them to the engine core: no data (the encoder is not run),
        # the identifier (the hash vLLM keys the image's blocks by) and the placeholder range, sorted by offset
        features = [self.v.MultiModalFeatureSpec(
            data=None, modality="image", identifier=str(ident),
            mm_position=self.v.PlaceholderRange(offset=int(offset), length=int(length)))
            for ident, offset, length in sorted(mm or (), key=lambda image: int(image[1]))]
        return self.v.Request(request_id=f"r{self._ids}", prompt_token_ids=list(tokens), sampling_params=params,
                              pooling_params=None, lora_request=lora, cache_salt=cache_salt,
                              mm_features=features or None, block_hasher=self._hasher)

    def match(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None,
              mm: Sequence[Image] | None = None, device_only: bool = False) -> int:
        """Tokens vLLM would reuse for this prompt now: its prefix hit, extended (with a CPU tier, unless
        ``device_only``) by what the offload connector would load (nothing allocated)."""
        request = self._request(tokens, lora_name, cache_salt, mm)
        _blocks, hit, *_ = self.manager.get_computed_blocks(request)
        if self.offload is not None and not device_only:
            hit = self.offload.hit(request, int(hit))
        return int(hit)

    def prefill(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None,
                mm: Sequence[Image] | None = None) -> int:
        """Serve one prompt as the scheduler does, then finish it: look up the prefix, allocate the rest
        (which caches the prompt's full blocks), free; with a CPU tier, its complete chunks are stored there
        too. Returns vLLM's prefix hit in tokens, or raises MemoryError when the cache cannot hold the prompt
        (vLLM would not schedule it)."""
        request = self._request(tokens, lora_name, cache_salt, mm)
        blocks, hit, *_ = self.manager.get_computed_blocks(request)
        if self._split is None:
            if self.manager.allocate_slots(request, request.num_tokens - hit, hit, blocks) is None:
                raise MemoryError(f"vLLM cannot allocate {request.num_tokens} tokens in this cache")
        else:
            self._prefill_steps(request, hit, blocks)
        if self.offload is not None:
            self.offload.store(request)
        self.manager.free(request)
        return int(hit)

    def _prefill_steps(self, request: Any, hit: int, blocks: Any) -> None:
        """The prefill in the scheduler's steps, as vLLM's scheduler runs one request: each step starts
        (``new_step_starts``), is clipped by the Mamba split, allocated (the first with the prefix hit), then
        counted computed; an ``'align'`` Mamba group keeps a state where a step ends at a block boundary."""
        first = True
        while (remaining := request.num_tokens - request.num_computed_tokens - (hit if first else 0)) > 0:
            local = hit if first else 0
            self.manager.new_step_starts()
            n = self._split(request, remaining, local)
            if n <= 0 or self.manager.allocate_slots(request, n, local, blocks if first else None) is None:
                raise MemoryError(f"vLLM cannot allocate {request.num_tokens} tokens in this cache")
            request.num_computed_tokens += local + n
            first = False

    def reset(self) -> bool:
        """Reset the prefix cache as vLLM's scheduler does for an idle engine (``Scheduler.reset_prefix_cache``
        with no running request calls ``KVCacheManager.reset_prefix_cache``): every block's hash dropped, and
        ``AllBlocksCleared`` queued, published with the next :meth:`take_events` (vLLM's scheduler publishes
        queued events only after a model step). False: vLLM refused (a block still in use)."""
        return bool(self.manager.reset_prefix_cache())

    def take_events(self, *, publish: bool = True) -> list[Any]:
        """vLLM's events since the last call (its own structs), the offload connector's after the cache's, as
        vLLM's scheduler gathers them; published first when a publisher is set."""
        events = list(self.manager.take_events())
        if self.offload is not None:
            events += self.offload.take_events()
        if publish and events and self._publisher is not None:
            self._publisher.publish(self._batch(list(events)))
        return list(events)

    def _batch(self, events: list[Any]) -> Any:
        return self.v.kv_events.KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._dp_rank)

    def publish_sentinel(self, engine_hash: int, token: int, block_size: int | None = None) -> None:
        """One root block with vLLM's own ``BlockStored`` on the same publisher: an ingestion barrier
        (everything published before it was relayed once the router indexed it); ``block_size``: the
        relay's, where it is configured with another than vLLM's."""
        if self._publisher is None:
            raise RuntimeError("this cache has no publisher")
        b = block_size or self.block_size
        ev = self.v.kv_events.BlockStored(block_hashes=[engine_hash], parent_block_hash=None, token_ids=[token] * b,
                                          block_size=b, lora_id=None, medium="GPU", lora_name=None)
        self._publisher.publish(self._batch([ev]))

    def close(self) -> None:
        if self._publisher is not None:
            self._publisher.shutdown()
            self._publisher = None


def int_hashes() -> bool:
    """Whether this vLLM publishes 64-bit int block hashes (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    from vllm import envs

    return bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
