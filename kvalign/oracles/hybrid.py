"""SGLang's real ``UnifiedRadixCache`` for a hybrid model: full attention beside a sliding window or Mamba state.

Hybrid models keep, next to the full-attention KV the router indexes, state that SGLang evicts on
its own: the sliding window's KV (``ComponentType.SWA``, gpt-oss / Gemma 3 style) or the Mamba /
linear-attention state (``ComponentType.MAMBA``, Qwen3-Next style). SGLang reuses a prefix only up
to the last point where that state survives, and evicting only that state publishes no removal.
This oracle builds the cache the way SGLang 0.5.23's own unit tests do
(``sglang/test/kits/unified_radix_cache/fixtures.py: build_fixture``: the same pools, allocators
and ``CacheInitParams``), with two differences: the device is ``"cpu"`` (the kit asks
``get_device()``, which has no CPU answer) and the tree core is SGLang's own (Python or Rust), not
the kit's inspector wrappers. ``tests/unit/oracles/test_hybrid_oracle.py`` holds it to the kit's builder.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.sglang import _modules, request_key, sglang_version

#: SGLang releases this oracle's builder was read against (its pools, ``CacheInitParams`` fields, ``EvictParams``).
SUPPORTED = ("0.5.23",)
#: The hybrid components this oracle builds beside FULL.
COMPONENTS = ("swa", "mamba")
#: Tree cores: SGLang 0.5.23's default (Rust, which supports SWA and Mamba) and its Python core.
CORES = ("rust", "python")
#: Full-attention KV slots per cache (more than any generated example fills: eviction is asked for).
KV_TOKENS = 1024
#: Requests (each insert into a Mamba tree takes one request slot and its Mamba slot, as the kit's).
MAX_REQS = 64


@dataclass(frozen=True)
class Reuse:
    """What SGLang's ``match_prefix`` says of a prompt, in tokens (bigram units under EAGLE).

    ``reusable``: ``device_prefix_len``, the prefix a request reuses (every component's state
    intact); ``full``: ``full_kv_hit_length``, the prefix whose full-attention KV is held, the
    pages SGLang's events stored and did not remove."""

    reusable: int
    full: int


def version_problem(version: str) -> str | None:
    """Why the hybrid rows cannot run with this SGLang, or None."""
    if version in SUPPORTED:
        return None
    return (f"kvalign's hybrid-cache oracle (kvalign/oracles/hybrid.py) is pinned to SGLang {', '.join(SUPPORTED)}; "
            f"SGLang {version}'s UnifiedRadixCache components are unchecked")


def eagle_allowed(component: str) -> str | None:
    """Why SGLang keys a tree with this component in plain tokens even for an EAGLE worker, or None.

    SGLang 0.5.23 ``UnifiedTreeCore.__init__``: ``self.is_eagle = params.is_eagle and
    ComponentType.MAMBA not in components`` (read from the installed source, not assumed)."""
    import inspect

    from sglang.srt.mem_cache.unified_cache import unified_tree_core

    src = inspect.getsource(unified_tree_core)
    if component == "mamba" and "params.is_eagle and ComponentType.MAMBA not in components" in src:
        return ("SGLang keys a Mamba tree in plain tokens even with EAGLE on (unified_tree_core.py: "
                "is_eagle = params.is_eagle and ComponentType.MAMBA not in components)")
    return None


class HybridCache:
    """One real ``UnifiedRadixCache(FULL, SWA)`` or ``(FULL, MAMBA)`` with KV events on."""

    def __init__(self, component: str, page_size: int, *, eagle: bool, window: int = 4, core: str = "rust",
                 dynamo_format: bool = False) -> None:
        if component not in COMPONENTS:
            raise ValueError(f"unknown hybrid component {component!r}; expected one of {COMPONENTS}")
        if core not in CORES:
            raise ValueError(f"unknown tree core {core!r}; expected one of {CORES}")
        m = _modules()
        if m.UnifiedRadixCache is None:
            raise OracleUnavailable(f"sglang {sglang_version()} has no unified radix cache ({m.unified_missing})")
        try:
            self._build(component, page_size, eagle, window, core, dynamo_format)
        except Exception as exc:  # an import chain or constructor this release does not have: say which
            raise OracleUnavailable(f"SGLang {sglang_version()} cannot build a {component} cache here: "
                                    f"{type(exc).__name__}: {exc}") from None
        self._m = m
        self.component, self.page_size, self.eagle, self.window = component, page_size, eagle, window
        self.take_raw_events()  # construction queues one AllBlocksCleared

    def _build(self, component: str, page_size: int, eagle: bool, window: int, core: str, dynamo_format: bool) -> None:
        """``build_fixture``'s pools for one component, with its defaults (``CacheConfig``)."""
        import torch
        from sglang.kernels.ops.attention.fla.chunk_delta_h import CHUNK_SIZE
        from sglang.srt.environ import envs
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.events import KvEventLoraNames
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.mem_cache.unified_cache.tree_core_registry import resolve_tree_core_backend
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

        num_layers, full_ids = 24, (3, 7, 11, 15, 19, 23)
        other_ids = [i for i in range(num_layers) if i not in full_ids]
        dtype, head_num, head_dim, device = torch.bfloat16, 2, 64, "cpu"
        mamba = component == "mamba"
        extra_buffer = mamba and page_size > 1  # Mamba with page_size > 1 needs the extra buffer (the kit's note)
        args = ServerArgs(model_path="dummy", page_size=page_size)
        args._mamba_cache_chunk_size = max(CHUNK_SIZE, page_size)
        set_global_server_args_for_scheduler(args)
        if mamba:
            from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
            from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
            from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

            with envs.SGLANG_MAMBA_SSM_DTYPE.override("bfloat16"):
                shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=256, n_groups=1, num_heads=2,
                                                head_dim=16, state_size=16, conv_kernel=4)
                params = Mamba2CacheParams(shape=shape, layers=other_ids)
            self.pool = HybridReqToTokenPool(size=MAX_REQS, mamba_size=MAX_REQS, mamba_spec_state_size=MAX_REQS,
                                             max_context_len=512, device=device, enable_memory_saver=False,
                                             cache_params=params, mamba_layer_ids=other_ids,
                                             enable_mamba_extra_buffer=extra_buffer, speculative_num_draft_tokens=3)
            kv = HybridLinearKVPool(size=KV_TOKENS, dtype=dtype, page_size=page_size, head_num=head_num,
                                    head_dim=head_dim, full_attention_layer_ids=full_ids, device=device,
                                    enable_memory_saver=False, mamba_pool=self.pool.mamba_pool)
            self.allocator = TokenToKVPoolAllocator(size=KV_TOKENS, dtype=dtype, device=device, kvcache=kv,
                                                    need_sort=False)
            components = (ComponentType.FULL, ComponentType.MAMBA)
        else:
            from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
            from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
            from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

            self.pool = ReqToTokenPool(size=MAX_REQS, max_context_len=512, device=device, enable_memory_saver=False)
            kv = SWAKVPool(size=KV_TOKENS, size_swa=KV_TOKENS, page_size=page_size, dtype=dtype, head_num=head_num,
                           head_dim=head_dim, swa_attention_layer_ids=other_ids, full_attention_layer_ids=full_ids,
                           device=device)
            self.allocator = SWATokenToKVPoolAllocator(size=KV_TOKENS, size_swa=KV_TOKENS, page_size=page_size,
                                                       dtype=dtype, device=device, kvcache=kv, need_sort=False)
            components = (ComponentType.FULL, ComponentType.SWA)
        self.lora_names = KvEventLoraNames()
        params = CacheInitParams(
            req_to_token_pool=self.pool, token_to_kv_pool_allocator=self.allocator, page_size=page_size,
            disable=False, sliding_window_size=None if mamba else window, tree_components=components,
            enable_mamba_extra_buffer=extra_buffer, enable_kv_cache_events=True,
            dynamo_kv_event_format=dynamo_format, kv_event_lora_names=self.lora_names, is_eagle=eagle,
            tree_core_backend=core)
        resolve_tree_core_backend(core, params)
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override(core):
            self.cache = UnifiedRadixCache(params=params)
        self._rid = 0

    @property
    def core(self) -> str:
        return type(self.cache.tree_core).__name__

    def _key(self, tokens: Sequence[int], lora_name: str | None, cache_salt: str | None) -> Any:
        return request_key(tokens, lora_name, cache_salt, self.lora_names)

    def _alloc(self, n: int) -> Any:
        """The kit's ``_alloc``: the SWA allocator's own ``alloc`` asserts page size 1, so page-aligned
        full and window slots are taken and mapped as its ``alloc_extend`` does."""
        if self.component == "swa" and self.page_size > 1:
            p = self.page_size
            aligned = (n + p - 1) // p * p
            full = self.allocator.full_attn_allocator.alloc(aligned)
            swa = self.allocator.swa_attn_allocator.alloc(aligned)
            if full is None or swa is None:
                raise OracleUnavailable(f"the hybrid cache's {KV_TOKENS}-slot pools ran out")
            self.allocator.full_to_swa_index_mapping[full] = swa
            return full[:n]
        value = self.allocator.alloc(n)
        if value is None:
            raise OracleUnavailable(f"the hybrid cache's {KV_TOKENS}-slot pool ran out")
        return value

    def insert(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None) -> int:
        """Cache a finished request's whole pages (the kit's ``_insert``: a Mamba tree gets the request's
        Mamba slot with it); returns the prefix that was already cached."""
        units = len(tokens) - self.eagle_keys
        whole = max(units, 0) // self.page_size * self.page_size
        if not whole:
            return 0
        tokens = list(tokens[: whole + self.eagle_keys])
        key = self._key(tokens, lora_name, cache_salt)
        params = self._m.bpc.InsertParams(key=key, value=self._alloc(len(key)))
        if self.component == "mamba":
            from sglang.srt.managers.schedule_batch import Req
            from sglang.srt.sampling.sampling_params import SamplingParams

            req = Req(rid=self._rid, origin_input_text="", origin_input_ids=array("q"),
                      sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
            self._rid += 1
            if self.pool.alloc([req]) is None:
                raise OracleUnavailable(f"the Mamba cache's {MAX_REQS} request slots ran out")
            params.mamba_value = req.kv.mamba_pool_idx.unsqueeze(0)
        return int(self.cache.insert(params).prefix_len)

    def insert_decoded(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None) -> int:
        """A request that decoded up to ``tokens`` cached as SGLang's production path caches it: while it ran,
        the scheduler's ``maybe_evict_swa`` freed its window slots behind the sliding window
        (``UnifiedRadixCache.evict_sliding_windows`` -> ``free_swa_out_of_window_slots``, run here on the
        request's own ``req_to_token`` row: SGLang's code, no event); the finished request is then inserted
        with that evicted length (``component_evicted_seqlens``), so its pages behind the window enter the tree
        as window tombstones while their full-attention KV is published as stored. Returns the evicted length
        (KV slots), 0 where the request never outgrew its window. SWA trees only."""
        if self.component != "swa":
            raise ValueError("insert_decoded is the sliding-window path; a Mamba tree has no window")
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
        from sglang.srt.sampling.sampling_params import SamplingParams

        whole = max(len(tokens) - self.eagle_keys, 0) // self.page_size * self.page_size
        if not whole:
            return 0
        tokens = list(tokens[: whole + self.eagle_keys])
        key = self._key(tokens, lora_name, cache_salt)
        value = self._alloc(len(key))
        req = Req(rid=self._rid, origin_input_text="", origin_input_ids=array("q", tokens),
                  sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        self._rid += 1
        if self.pool.alloc([req]) is None:
            raise OracleUnavailable(f"the SWA cache's {MAX_REQS} request slots ran out")
        self.pool.req_to_token[req.kv.req_pool_idx, : len(key)] = value
        self.cache.evict_sliding_windows(req, len(key) - 1)  # the decode step's pre_len: seqlen - 1
        evicted = int(req.kv.get_evicted_seqlen(ComponentType.SWA))
        self.cache.insert(self._m.bpc.InsertParams(key=key, value=value,
                                                   component_evicted_seqlens={ComponentType.SWA: evicted}))
        self.pool.free(req)
        return evicted

    @property
    def eagle_keys(self) -> int:
        """1 when SGLang keys this tree by bigrams (EAGLE, and not a Mamba tree), else 0."""
        return int(bool(self.cache.tree_core.is_eagle))

    def match(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None) -> Reuse:
        r = self.cache.match_prefix(self._m.bpc.MatchPrefixParams(key=self._key(tokens, lora_name, cache_salt)))
        return Reuse(int(r.device_prefix_len), int(r.full_kv_hit_length))

    def evict(self, num_tokens: int) -> int:
        """Full-attention eviction (whole leaves; SGLang publishes their removal)."""
        return int(self.cache.evict(self._m.bpc.EvictParams(num_tokens=num_tokens)).num_tokens_evicted)

    def evict_state(self, amount: int) -> int:
        """Evict only the hybrid state: ``swa_num_tokens`` window tokens, or ``mamba_num`` Mamba states."""
        if self.component == "swa":
            res = self.cache.evict(self._m.bpc.EvictParams(num_tokens=0, swa_num_tokens=amount))
            return int(res.swa_num_tokens_evicted)
        res = self.cache.evict(self._m.bpc.EvictParams(num_tokens=0, mamba_num=amount))
        return int(res.mamba_num_evicted)

    def take_raw_events(self) -> list[Any]:
        return list(self.cache.take_events())
