"""vLLM's CPU offload tier, in the vLLM interpreter: what the ``OffloadingConnector``'s scheduler side stores,
publishes and loads back, with vLLM's own pieces (vLLM 0.32; vllm#57159 is about this path).

Real: ``CPUOffloadingManager`` (the CPU tier's chunk pool, its LRU, lookups and raw events; it runs in the
scheduler and moves no KV itself), ``OffloadingEventsTracker`` (which turns the manager's per-chunk events into
the self-describing ``BlockStored`` / ``BlockRemoved`` the connector publishes, medium ``CPU``: one event per
chunk naming every block hash in it), the chunk keys (``make_offload_key`` of each chunk's last block hash,
``RequestOffloadState.update_offload_keys``) and the load lookup (``OffloadingConnectorScheduler.
_maximal_prefix_lookup``, run as vLLM's function on this object).

Stand-in, and why: ``OffloadingConnectorScheduler`` itself needs a whole ``VllmConfig`` (a model's config
among it) and an ``OffloadingSpec`` that sizes pinned CPU tensors for a GPU worker; here the two of its steps
that decide what is stored and what loads are kept as vLLM writes them and called directly: a request's
complete chunks are stored when it finishes (the connector stores as blocks are computed; for one prefill
that is the same set), and a lookup starts at the chunk holding the GPU prefix hit, as ``_lookup_complete_chunks``
does for a full-attention group (no ``max_load_tokens``, no EAGLE, no partial tail). No KV moves: the
GPU<->CPU transfer is the worker side's, which decides nothing about keys.
"""

from __future__ import annotations

import types
from typing import Any

#: vLLM's chunk pool policy and event capture, as ``--kv-transfer-config`` sets them for the CPU tier
POLICY = "lru"


class CpuOffload:
    """A CPU tier of ``num_chunks`` chunks of ``blocks_per_chunk`` blocks behind one full-attention group."""

    def __init__(self, group: Any, block_size: int, *, blocks_per_chunk: int, num_chunks: int) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading import events, scheduler
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
        from vllm.v1.kv_offload import base
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        self._base, self._scheduler = base, scheduler
        self.manager = CPUOffloadingManager(num_chunks=num_chunks, cache_policy=POLICY, enable_events=True)
        self._events_tracker = events.OffloadingEventsTracker(
            base.OffloadingKVEventsConfig(enable_kv_cache_events=True, self_describing_kv_events=True))
        self.group = scheduler.GroupOffloadConfig(
            group_idx=0, tokens_per_block=block_size, tokens_per_chunk=block_size * blocks_per_chunk,
            hashes_per_chunk=blocks_per_chunk, kv_event_group_spec=events.get_offloading_event_group_spec(group),
            sliding_window_size_in_chunks=None, kv_cache_spec=group.kv_cache_spec, manager_cls=FullAttentionManager)
        #: the scheduler's own lookup, bound to this object (it reads ``manager`` and ``_events_tracker``)
        self._lookup = types.MethodType(scheduler.OffloadingConnectorScheduler._maximal_prefix_lookup, self)

    def _keys(self, request: Any) -> tuple[list[Any], Any]:
        """The request's chunk keys (vLLM's ``update_offload_keys`` on a request state of this one group)."""
        group_state = types.SimpleNamespace(offload_keys=[])
        state = types.SimpleNamespace(config=types.SimpleNamespace(kv_group_configs=[self.group]),
                                      group_states=[group_state], req=request,
                                      req_context=self._base.ReqContext(req_id=request.request_id))
        self._scheduler.RequestOffloadState.update_offload_keys(state)
        return group_state.offload_keys, state.req_context

    def store(self, request: Any) -> None:
        """Store the request's complete chunks in the CPU tier (``prepare_store`` evicts LRU chunks for room;
        ``complete_store`` makes them loadable), recording each chunk's event payload as the connector does."""
        keys, _ctx = self._keys(request)
        keys = keys[: len(request.all_token_ids) // self.group.tokens_per_chunk]  # complete chunks only
        for chunk_idx, key in enumerate(keys):
            self._events_tracker.record_store(request, self.group, chunk_idx, key)
        ctx = self._base.ReqContext(req_id=request.request_id)
        out = self.manager.prepare_store(keys, ctx)
        if out is not None:
            self.manager.complete_store(out.keys_to_store, ctx)

    def hit(self, request: Any, computed: int) -> int:
        """Tokens of the prompt held after the connector's load: ``computed`` (the GPU hit) extended by the
        consecutive complete chunks the CPU tier holds from the chunk containing it."""
        keys, ctx = self._keys(request)
        tpc = self.group.tokens_per_chunk
        if len(keys) * tpc - computed < tpc:
            return computed
        start = computed // tpc
        hits = self._lookup(keys[start:], ctx, request, self.group, start) or 0
        return max(computed, (start + hits) * tpc)

    def take_events(self) -> list[Any]:
        """The connector's events since the last call (``OffloadingConnectorScheduler.take_events``)."""
        return list(self._events_tracker.take_events(self.manager.take_events()))
