"""Prometheus metrics for ``kvalign watch``, so a cache-blind router can be alerted on.

Operators run Dynamo + SGLang for weeks and watch them with Prometheus (both export metrics);
a terminal view helps only while someone looks at it. ``kvalign watch --metrics-port`` runs as a
sidecar and serves what the watcher sees, one ``worker`` label per watched KV-event stream.

The metrics are read from the watchers at scrape time (a custom collector) rather than kept in
separate counters: the watcher already counts everything for its terminal lines and summary, so
the two can never disagree, and nothing is done between scrapes. Names follow Prometheus
conventions: ``kvalign_watch_`` prefix, counters end in ``_total``, time in seconds.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvalign.streams.watch import BLIND_REASONS, Watcher

PREFIX = "kvalign_watch_"


class WatchCollector(Collector):
    """Exposes the state of each named :class:`~kvalign.streams.watch.Watcher` (worker label = its name)."""

    def __init__(self, watchers: Mapping[str, Watcher]) -> None:
        self.watchers = watchers

    def collect(self) -> Iterator[Metric]:
        def counter(name: str, doc: str, value: Any) -> Metric:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["worker"])
            for worker, w in self.watchers.items():
                family.add_metric([worker], value(w))
            return family

        yield counter("batches_received", "KV-event batches received from the worker's publisher",
                      lambda w: w.totals.batches)
        yield counter("events_received", "KV events in the decoded batches", lambda w: w.totals.events)
        yield counter("blocks_stored", "blocks the engine reported stored", lambda w: w.totals.stored)
        yield counter("blocks_removed", "blocks the engine reported removed", lambda w: w.totals.removed)
        yield counter("sequence_gaps", "jumps in the publisher's batch sequence numbers", lambda w: len(w.totals.seq.gaps))
        yield counter("batches_missing", "batches the sequence numbers say were never received",
                      lambda w: w.totals.seq.missing_batches)
        yield counter("publisher_restarts", "times the sequence went back (a new engine process)",
                      lambda w: len(w.totals.seq.restarts))
        yield counter("malformed_batches", "batches that did not decode (Dynamo's relay drops them too)",
                      lambda w: sum(w.totals.malformed.values()))
        yield counter("orphan_stores", "stored events the router drops because their parent was never indexed",
                      lambda w: w.orphan_stores())
        blind = CounterMetricFamily(PREFIX + "router_blind_blocks", "blocks the engine holds that the router can "
                                    "never match, by reason", labels=["worker", "reason"])
        for worker, w in self.watchers.items():
            for reason in BLIND_REASONS:
                blind.add_metric([worker, reason], w.totals.blind[reason])
        yield blind
        unmapped = CounterMetricFamily(PREFIX + "unmapped_medium_blocks", "blocks stored with a medium the router's "
                                       "relay maps to no tier (indexed nowhere, silently), by medium",
                                       labels=["worker", "medium"])
        tiers = GaugeMetricFamily(PREFIX + "blocks_held", "engine blocks the router's relay holds for the worker, per "
                                  "tier (device, host_pinned, disk, external)", labels=["worker", "tier"])
        for worker, w in self.watchers.items():
            for medium, n in w.totals.unmapped_media.items():
                unmapped.add_metric([worker, medium], n)
            for tier, n in w.blocks_held_per_tier().items():
                tiers.add_metric([worker, tier], n)
        yield from (unmapped, tiers)
        held = GaugeMetricFamily(PREFIX + "router_blocks_held", "blocks the router's index holds for the worker",
                                 labels=["worker"])
        last = GaugeMetricFamily(PREFIX + "last_batch_timestamp_seconds", "Unix time the last batch was received",
                                 labels=["worker"])
        cause = InfoMetricFamily(PREFIX + "last_cause", "the last named cause of router blindness seen, and the "
                                 "sequence number of the batch that showed it", labels=["worker"])
        for worker, w in self.watchers.items():
            held.add_metric([worker], w.blocks_held())
            if w.totals.last_batch_unix is not None:
                last.add_metric([worker], w.totals.last_batch_unix)
            if w.totals.last_cause is not None:
                c, seq = w.totals.last_cause
                cause.add_metric([worker], {"cause": c.name, "description": c.value, "seq": str(seq)})
        yield from (held, last, cause)


def serve(watchers: Mapping[str, Watcher], host: str, port: int) -> Any:
    """Serve ``/metrics`` for ``watchers`` on ``host:port`` (port 0: any free port); returns the server.

    Its own registry, so the process's default collectors (GC, platform) stay out of the sidecar's
    series. The server thread is a daemon: it ends with ``kvalign watch``.
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WatchCollector(watchers))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
