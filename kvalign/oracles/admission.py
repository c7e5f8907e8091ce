"""One request through SGLang's own scheduler code on CPU: matched, admitted, prefilled, finished and cached.

What the engine reuses of a prompt is not what its radix tree holds: the scheduler caps the match
(``Req._compute_max_prefix_len``: at most ``input_len - 1`` tokens, lower with ``logprob_start_len``)
and decides the load-back of a host-only stretch in its prefill admission (``PrefillAdder.add_one_req``
-> ``UnifiedRadixCache.init_load_back`` -> ``_load_back_transfers``, which declines a stretch shorter
than ``load_back_threshold``). So a request here is a real ``Req`` taken through the calls
``Scheduler._get_new_batch_prefill_raw`` makes for it, in its order:

1. ``req.init_next_round_input(tree_cache)``: SGLang's cap and ``match_kv_cache``;
2. a fresh ``PrefillAdder`` and ``add_one_req``: the memory budget, the load-back decision and
   SGLang's eviction on allocation (``evict_for_alloc``) when the device pool is short;
3. ``ScheduleBatch.init_new(...).prepare_for_extend()``: the extend allocated by
   ``alloc_for_extend`` (eviction on allocation again: ``evict_from_tree_cache``), and SGLang's own
   ``cached_tokens`` accounting;
4. one output token, ``FINISH_LENGTH``, then ``release_kv_cache(req, tree_cache, checkpoint=True)``
   as ``process_batch_result_prefill`` does for a finished request: the prompt is cached.

kvalign's own part is only that driving loop (one request per batch, no forward pass: the model's
output does not change what is cached; a request the adder defers is not retried here), mirroring
``Scheduler._get_new_batch_prefill_raw`` and ``process_batch_result_prefill`` (``managers/scheduler.py``,
``managers/scheduler_components/batch_result_processor.py``); docs/check.md names it, and the live
HiCache fuzz holds it to a running engine. The server config and the model config it reads stand in
(:mod:`kvalign.standins.scheduler`).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

#: Requests a tree's request pool holds at once (one runs at a time here).
REQ_SLOTS = 4
#: Longest request, in tokens, a request-pool row holds (the machine's prompts stay far below).
MAX_CONTEXT = 2048


@dataclass(frozen=True)
class Admission:
    """One request as SGLang's scheduler admitted it, in KV slots (tokens; bigrams under EAGLE).

    ``device_tokens`` / ``host_only_tokens``: the capped match (``req.prefix_len`` /
    ``req.host_hit_length`` after ``init_next_round_input``); ``loaded_tokens``: what
    ``init_load_back`` loaded back (``req.host_loaded_length``); ``cached_tokens``: what SGLang
    reports to the client (``req.cached_tokens``); ``max_prefix_tokens``: the cap
    (``Req._compute_max_prefix_len``, raw tokens). ``admitted`` False: the adder deferred it
    (``result`` names why) and nothing was prefilled or cached.
    """

    prompt_tokens: int
    max_prefix_tokens: int
    device_tokens: int
    host_only_tokens: int
    loaded_tokens: int
    cached_tokens: int
    admitted: bool
    result: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Scheduler:
    """SGLang's scheduler code for one worker's tree cache, one request at a time."""

    _rids = itertools.count()

    def __init__(self, cache: Any, allocator: Any, req_to_token_pool: Any, page_size: int, eagle: bool,
                 context: Any, lora_names: Any = None) -> None:
        self.cache, self.allocator, self.pool = cache, allocator, req_to_token_pool
        self.page_size, self.eagle, self.context = page_size, eagle, context
        self._lora_names = lora_names

    @contextmanager
    def sglang(self) -> Iterator[None]:
        """SGLang's process config published for the duration of a call into its scheduler code."""
        from sglang.srt.runtime_context import use_context

        with use_context(self.context):
            yield

    def request(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None,
                logprob_start_len: int | None = None) -> Any:
        """A real ``Req`` for this tenant (the LoRA id appended to ``extra_key`` by ``Req`` itself)."""
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        from kvalign.oracles.sglang import lora_id_for

        lora_id = lora_id_for(lora_name) if lora_name else None
        req = Req(f"kvalign-{next(self._rids)}", "", array("q", [int(t) for t in tokens]),
                  SamplingParams(max_new_tokens=1), return_logprob=logprob_start_len is not None,
                  lora_id=lora_id, cache_salt=cache_salt or None)
        if logprob_start_len is not None:
            req.logprob_start_len = logprob_start_len
        if lora_name and self._lora_names is not None:
            self._lora_names.register(req, lora_name)
        return req

    def serve(self, tokens: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None,
              logprob_start_len: int | None = None) -> Admission:
        """Admit, prefill and finish one request; its prompt is then cached as SGLang caches it."""
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH, ScheduleBatch
        from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
        from sglang.srt.mem_cache.common import release_kv_cache
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from kvalign.standins.scheduler import MODEL_CONFIG

        req = self.request(tokens, lora_name, cache_salt, logprob_start_len)
        with self.sglang():
            req.init_next_round_input(self.cache)
            cap = req._compute_max_prefix_len(len(req.full_untruncated_fill_ids))
            device, host = int(req.prefix_len), int(req.host_hit_length)
            adder = PrefillAdder(self.page_size, self.cache, self.allocator, None, 0.0, MAX_CONTEXT, None)
            result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
            admitted = req in adder.can_run_list
            if not admitted:
                return Admission(len(tokens), cap, device, host, int(req.host_loaded_length), 0, False,
                                 getattr(result, "name", str(result)))
            batch = ScheduleBatch.init_new([req], self.pool, self.allocator, self.cache, MODEL_CONFIG, False,
                                           SpeculativeAlgorithm.NONE)
            batch.prepare_for_extend()
            req.output_ids.append(0)
            req.finished_reason = FINISH_LENGTH(length=1)
            release_kv_cache(req, self.cache, checkpoint=True)
        return Admission(len(tokens), cap, device, host, int(req.host_loaded_length), int(req.cached_tokens), True,
                         AddReqResult.CONTINUE.name if result is AddReqResult.CONTINUE else result.name)


def device_allocator(page_size: int, size: int) -> Any:
    """SGLang's own device KV allocator for ``size`` slots, the class its model runner picks for the
    page size (no KV tensors: the cache and scheduler only hand slot ids around)."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    if page_size == 1:
        return TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
    return PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, False)


def req_to_token_pool() -> Any:
    """SGLang's own request -> token-slot table (``ReqToTokenPool``) on CPU."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return ReqToTokenPool(REQ_SLOTS, MAX_CONTEXT, "cpu", False)
