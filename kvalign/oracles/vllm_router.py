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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.router_path import SENTINEL_BASE, IngestWorker, LoopbackProxy, RouterPath, Transform, sentinel_hash
from kvalign.oracles.vllm import VllmEngine


@dataclass(frozen=True)
class _Sentinel:
    k: int


class VllmHop:
    """The publisher side :class:`IngestWorker` drives: barriers go through vLLM's own publisher (one
    stream, in order); vLLM's events are published by the engine itself, never through here."""

    def __init__(self, transform: Transform | None = None) -> None:
        self.hop = LoopbackProxy(transform)
        #: where the relay subscribes / where vLLM's publisher connects
        self.endpoint, self.engine_endpoint = self.hop.xpub, self.hop.xsub
        self.engine: VllmEngine | None = None

    def sentinel(self, k: int, page_size: int) -> _Sentinel:
        return _Sentinel(k)

    def publish(self, events: Sequence[Any]) -> None:
        if self.engine is None:
            raise OracleUnavailable("the vLLM hop has no engine yet")
        for ev in events:
            if not isinstance(ev, _Sentinel):
                raise TypeError("vLLM's events are published by vLLM's own publisher, not through the hop")
            self.engine.publish_sentinel(sentinel_hash(ev.k), SENTINEL_BASE + ev.k)

    def close(self) -> None:
        self.hop.close()


@dataclass
class VllmWorker:
    """One vLLM engine and the router that indexes its events."""

    engine: VllmEngine
    ingest: IngestWorker
    hop: VllmHop

    def sync(self) -> list[dict[str, Any]]:
        """Publish vLLM's pending events and wait until the router indexed them; returns the events.
        A relay that never indexes the barrier is :class:`OracleUnavailable`."""
        events = self.engine.take_events()
        if not self.ingest.barrier():
            raise OracleUnavailable("Dynamo's relay never indexed the barrier vLLM's publisher sent")
        return events

    def overlap(self, tokens: Sequence[int], *, lora_name: str | None = None, cache_namespace: str | None = None) -> int:
        """The router's device-tier overlap (blocks) for a query."""
        return self.ingest.overlap(tokens, lora_name, cache_namespace)

    def tiers(self, tokens: Sequence[int], *, lora_name: str | None = None, cache_namespace: str | None = None) -> dict[str, int]:
        """The router's per-tier overlap (``device_blocks``, ``host_pinned_extension_blocks``, ...)."""
        return self.ingest.path.query_tiers(self.ingest.router, list(tokens), lora_name, cache_namespace)

    def dump(self) -> list[tuple[int | None, int, int]]:
        """``(parent, vLLM's block hash, router local hash)`` per indexed block, barriers left out."""
        return [row for row in self.ingest.dump() if not sentinel_hash(0) <= row[1] < sentinel_hash(1 << 32)]

    def close(self) -> None:
        self.engine.close()
        self.hop.close()


def vllm_worker(path: RouterPath, block_size: int, num_blocks: int, *, medium: str = "GPU",
                transform: Transform | None = None, env: dict[str, str] | None = None) -> VllmWorker:
    """A vLLM engine (``num_blocks`` blocks of ``block_size``) publishing into a fresh relay + ``KvRouter``."""
    hop = VllmHop(transform)
    try:
        hop.engine = VllmEngine(block_size, num_blocks, medium=medium, endpoint=hop.engine_endpoint, env=env)
    except BaseException:
        hop.close()
        raise
    try:
        ingest = path.attach(hop, block_size)
        if not ingest.barrier():
            raise OracleUnavailable("Dynamo's relay never indexed vLLM's first barrier")
    except BaseException:
        hop.engine.close()
        hop.close()
        raise
    return VllmWorker(hop.engine, ingest, hop)
