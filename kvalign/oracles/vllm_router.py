"""The router side of a vLLM worker, wired as ``dynamo.vllm`` 1.6.1 wires it, on loopback.

``dynamo/vllm/main.py`` (``setup_kv_event_publisher``) builds, per data-parallel rank, one Rust
``KvEventPublisher`` in relay mode: ``kv_block_size`` = vLLM's cache block size (unless
``additional_config`` overrides it), ``zmq_endpoint`` = the ``--kv-events-config`` endpoint offset by
the rank (``ZmqEventPublisher.offset_endpoint_port``, ``*`` -> 127.0.0.1), ``zmq_topic=""``,
``enable_local_indexer`` on; ``dynamo/vllm/__main__.py`` sets ``PYTHONHASHSEED=0`` before vLLM loads.
Here, for rank 0:

    vLLM KVCacheManager -> vLLM ZmqEventPublisher (vLLM's interpreter) -> loopback hop
    -> Dynamo KvEventPublisher relay -> event plane -> KvRouter index

The relay and router are :class:`~kvalign.oracles.router_path.RouterPath`'s (the SGLang path's, with
the same registration); only the publisher is vLLM's. The hop is kvalign's XSUB/XPUB proxy: vLLM
*connects* to a concrete host (so nothing binds a wildcard), and a negative control can rewrite or
drop frames on it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.router_path import (POLL_FIRST_S, POLL_MAX_S, SENTINEL_BASE, IngestWorker, LoopbackProxy, RouterPath,
                                         sentinel_hash)
from kvalign.oracles.vllm import VllmEngine

#: Seconds a barrier waits for the router to index it (a loopback batch takes milliseconds; the rest is
#: a loaded machine delaying vLLM's process)
BARRIER_TIMEOUT_S = 30.0


class VllmHop:
    """The loopback hop between vLLM's publisher and the relay (the publisher :class:`IngestWorker` holds):
    vLLM's events and barriers are published by vLLM's own publisher, never through here
    (:meth:`VllmWorker.barrier`)."""

    def __init__(self) -> None:
        #: kvalign's proxy; a negative control sets its ``transform`` to rewrite or drop vLLM's batches
        self.hop = LoopbackProxy()
        #: where the relay subscribes / where vLLM's publisher connects
        self.endpoint, self.engine_endpoint = self.hop.xpub, self.hop.xsub

    def close(self) -> None:
        self.hop.close()


@dataclass
class VllmWorker:
    """One vLLM engine and the router that indexes its events."""

    engine: VllmEngine
    ingest: IngestWorker
    hop: VllmHop
    #: barrier numbers of this worker's own (far above the ones IngestWorker's barrier counts)
    _barriers: Iterator[int] = field(default_factory=lambda: itertools.count(1 << 20))

    def sync(self) -> list[dict[str, Any]]:
        """Publish vLLM's pending events and wait until the router indexed them; returns the events.
        A relay that never indexes the barrier is :class:`OracleUnavailable`."""
        events = self.engine.take_events()
        self.barrier()
        return events

    def barrier(self) -> None:
        """Publish a barrier block on vLLM's publisher and wait until the router indexed it (one stream, in
        order: everything vLLM published before it was relayed). vLLM's publisher sits in another process,
        whose answers a loaded machine can delay by seconds, so this waits up to BARRIER_TIMEOUT_S,
        re-sending each second (the first may precede the subscription). Never indexed:
        :class:`OracleUnavailable`."""
        k = next(self._barriers)
        deadline, sent_at, pause = time.monotonic() + BARRIER_TIMEOUT_S, 0.0, POLL_FIRST_S
        while time.monotonic() < deadline:
            if time.monotonic() - sent_at > 1.0:
                self.engine.publish_sentinel(sentinel_hash(k), SENTINEL_BASE + k, self.ingest.block_size)
                sent_at = time.monotonic()
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
            if any(h == sentinel_hash(k) for _p, h, _t in self.ingest.dump()):
                return
        raise OracleUnavailable(f"Dynamo's relay did not index vLLM's barrier within {BARRIER_TIMEOUT_S:.0f} s")

    def overlap(self, tokens: Sequence[int], *, lora_name: str | None = None, cache_namespace: str | None = None) -> int:
        """The router's device-tier overlap (blocks) for a query."""
        return self.ingest.overlap(tokens, lora_name, cache_namespace)

    def tiers(self, tokens: Sequence[int], *, block_mm_infos: list[Any] | None = None) -> dict[str, int]:
        """The router's per-tier overlap (``device_blocks``, ``host_pinned_extension_blocks``,
        ``disk_extension_blocks``) for a base-model query, with the frontend's per-block image infos when
        given (``get_overlap_scores``' ``block_mm_infos``)."""
        path, router = self.ingest.path, self.ingest.router
        if not hasattr(router, "get_overlap_scores"):
            raise OracleUnavailable(f"Dynamo {path.version}'s KvRouter has no get_overlap_scores")
        rows = path.call(router.get_overlap_scores, list(tokens), block_mm_infos=block_mm_infos)["workers"]
        keys = ("device_blocks", "host_pinned_extension_blocks", "disk_extension_blocks")
        return {k: int(rows[0][k]) for k in keys} if rows else dict.fromkeys(keys, 0)

    def dump(self) -> list[tuple[int | None, int, int]]:
        """``(parent, vLLM's block hash, router local hash)`` per indexed block, barriers left out."""
        return [row for row in self.ingest.dump() if not sentinel_hash(0) <= row[1] < sentinel_hash(1 << 32)]

    def close(self) -> None:
        self.engine.close()
        self.hop.close()


def vllm_worker(path: RouterPath, block_size: int, num_blocks: int, *, env: dict[str, str] | None = None,
                relay_block_size: int | None = None, **options: Any) -> VllmWorker:
    """A vLLM engine (``num_blocks`` blocks of ``block_size``; ``options``: :class:`VllmEngine`'s
    ``sliding_window`` / ``mamba`` / ``offload``) publishing into a fresh relay + ``KvRouter``.

    ``relay_block_size``: the relay's (and the registered card's, the router's) ``kv_block_size`` where it is
    not vLLM's, as ``dynamo.vllm`` runs with ``additional_config={"dynamo_kv_event_block_size": N}``
    (``dynamo/vllm/cache_info.py``); by default vLLM's, as ``dynamo.vllm`` reads it from the engine."""
    hop = VllmHop()
    try:
        engine = VllmEngine(block_size, num_blocks, endpoint=hop.engine_endpoint, env=env, **options)
    except BaseException:
        hop.close()
        raise
    try:
        worker = VllmWorker(engine, path.attach(hop, relay_block_size or block_size), hop)
        worker.barrier()
    except BaseException:
        engine.close()
        hop.close()
        raise
    return worker
