"""Two routing candidates under one real ``KvRouter``: the set-up in which a credit skew can change a choice.

A finding that the router credits pages the engine will not serve matters to a deployment only if it
changes where a request goes. Asking that needs a router with two candidates whose caches differ, so
this registers one worker whose card says ``data_parallel_size`` 2 and starts one Dynamo relay per
rank, each subscribed to its own SGLang ``ZmqEventPublisher`` (tagged with its rank, as a DP
scheduler tags its batches). Dynamo's scheduler scores every ``(worker_id, dp_rank)`` pair by the same
cost (overlap credit, prefill and decode load), so the two ranks are two candidates as two workers
would be; one in-process runtime cannot register two instances of one endpoint. The router is built
with the binding's default ``KvRouterConfig``, whose ``host_cache_hit_weight`` is passed explicitly
(:func:`~kvalign.oracles.router_path.configured_host_weight`), so the weight said is the weight used;
its ``disk_cache_hit_weight`` likewise (:func:`~kvalign.oracles.router_path.configured_disk_weight`).

Where both candidates cost the same, Dynamo's scheduler breaks the tie at random (issue 43 measured 22 vs
18 over 40 calls), so one ``best_worker`` call is a coin toss there: :meth:`RouterPair.picks` asks
``ROUTES`` times and returns how often each rank was picked, and a caller reads a split as a tie.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Sequence
from typing import Any

from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.router_path import (POLL_FIRST_S, RouterPath, SglangPublisher, configured_disk_weight,
                                        configured_host_weight, sentinel_hash)

#: How long one candidate's published events may take to show in the router's per-tier answer.
SETTLE_TIMEOUT_S = 6.0
RANKS = (0, 1)
#: How many times one state is routed (``best_worker`` records no load, so the calls are independent draws):
#: a tie picks each rank with probability 1/2, so 40 calls all landing on one rank is a 2**-39 chance.
ROUTES = 40


class RouterPair:
    """One worker with two data-parallel ranks (the two candidates), their relays and the router over them."""

    _names = itertools.count()

    def __init__(self, path: RouterPath, block_size: int, eagle: bool) -> None:
        self.path, self.block_size, self.eagle = path, block_size, eagle
        self.weight = configured_host_weight(path.core)
        self.disk_weight = configured_disk_weight(path.core)
        self.publishers = [SglangPublisher(attn_dp_rank=r) for r in RANKS]
        path.event_plane()  # its relays and router on an event plane of their own: no other worker's events
        try:
            self._endpoint, self._relays, self.router = path.call(self._start)
        except OracleUnavailable:
            self.close()
            raise
        except BaseException as exc:  # pyo3 panics are BaseExceptions
            self.close()
            raise OracleUnavailable(f"Dynamo {path.version} cannot start a two-rank worker and router: "
                                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        self._join()

    def _join(self) -> None:
        """Publish a sentinel page on each rank until the router indexed it (found by its engine hash in the
        router's dump, as :meth:`~kvalign.oracles.router_path.IngestWorker.barrier` does): a relay's ZMQ
        subscription joins after it starts, and what SGLang publishes before that is lost (the slow joiner)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        pending = {r: 2 * len(RANKS) * next(self._names) + r + 1 for r in RANKS}  # rank -> its sentinel's k
        while pending and time.monotonic() < deadline:
            for r, k in pending.items():
                self.publishers[r].publish([self.publishers[r].sentinel(k, self.block_size)])
            time.sleep(0.2)
            indexed = self._dumped()
            pending = {r: k for r, k in pending.items() if sentinel_hash(k) not in indexed}
        if pending:
            self.close()
            raise OracleUnavailable(f"the two-rank router never indexed rank(s) {sorted(pending)}'s sentinel page")

    def _dumped(self) -> set[int]:
        out = set()
        for entry in json.loads(self.path.call(self.router.dump_events)):
            data = entry["event"]["data"]
            stored = data.get("stored") if isinstance(data, dict) else None
            out.update(int(b["block_hash"]) for b in (stored or {}).get("blocks", ()))
        return out

    async def _start(self) -> tuple[Any, list[Any], Any]:
        c = self.path.core
        name = f"impact-b{self.block_size}-{'eagle' if self.eagle else 'plain'}-{next(self._names)}"
        endpoint = self.path.runtime.endpoint(f"kvalign-{name}.worker.generate")
        card = c.ModelRuntimeConfig()
        for field, value in (("enable_eagle", self.eagle), ("kv_event_publishing_enabled", True),
                             ("enable_local_indexer", True), ("data_parallel_start_rank", 0),
                             ("data_parallel_size", len(RANKS))):
            try:
                setattr(card, field, value)
            except AttributeError:
                raise OracleUnavailable(f"Dynamo {self.path.version}'s ModelRuntimeConfig has no {field}") from None
        kw: dict[str, Any] = {"kv_cache_block_size": self.block_size, "runtime_config": card}
        if hasattr(c, "WorkerType"):
            kw["worker_type"] = c.WorkerType.Aggregated
        await c.register_model(c.ModelInput.Tensor, c.ModelType.TensorBased, endpoint, name, **kw)
        await endpoint.register_endpoint_instance()
        relays = [c.KvEventPublisher(endpoint, kv_block_size=self.block_size, dp_rank=r,
                                     zmq_endpoint=self.publishers[r].endpoint, zmq_topic="", enable_local_indexer=True)
                  for r in RANKS]
        router = c.KvRouter(endpoint, self.block_size,
                            c.KvRouterConfig(use_kv_events=True, host_cache_hit_weight=self.weight,
                                             disk_cache_hit_weight=self.disk_weight))
        return endpoint, relays, router

    def publish(self, rank: int, events: Sequence[Any]) -> None:
        if events:
            self.publishers[rank].publish(events)

    def tiers(self, tokens: Sequence[int]) -> dict[int, tuple[int, int, int]]:
        """``dp_rank -> (device blocks, host-only blocks past them, disk-only blocks past both)`` as the router
        reports them."""
        rows = self.path.call(self.router.get_overlap_scores, list(tokens))["workers"]
        return {int(r["dp_rank"]): (int(r["device_blocks"]), int(r["host_pinned_extension_blocks"]),
                                    int(r["disk_extension_blocks"])) for r in rows}

    def settle(self, tokens: Sequence[int], expected: dict[int, tuple[int, ...]]) -> None:
        """Wait until the router's per-tier answer for ``tokens`` is ``expected`` on every rank (what each
        engine's tree holds; ``(device, host)`` or ``(device, host, disk)``): the choice is then asked of the
        state the engines published."""
        deadline, seen, pause = time.monotonic() + SETTLE_TIMEOUT_S, {}, POLL_FIRST_S
        while time.monotonic() < deadline:
            seen = self.tiers(tokens)
            if all(seen.get(r, (0, 0, 0))[: len(want)] == tuple(want) for r, want in expected.items()):
                return
            time.sleep(pause)  # from 1 ms up: what the engines publish on loopback is indexed within milliseconds
            pause = min(2 * pause, 0.05)
        raise OracleUnavailable(f"the two-rank router never indexed what the engines hold: expected {expected}, "
                                f"the router reports {seen} (rank: device, host blocks)")

    def choice(self, tokens: Sequence[int]) -> int:
        """The rank the router's own ``best_worker`` picks for ``tokens`` once (query only: no load recorded)."""
        return int(self.path.call(self.router.best_worker, list(tokens))[1])

    def picks(self, tokens: Sequence[int], n: int = ROUTES) -> tuple[int, int]:
        """How many of ``n`` routings of ``tokens`` picked rank 0 and rank 1: one rank every time is the router's
        choice, an even split a tie it broke at random (:data:`kvalign.verify.engine.trials.TIE_SHARE` draws the line)."""
        counts = [0, 0]
        for _ in range(n):
            counts[self.choice(tokens)] += 1
        return counts[0], counts[1]

    def close(self) -> None:
        for p in self.publishers:
            p.close()
