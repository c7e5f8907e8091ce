"""Record the decode half of a disaggregated run: the transfer under each request, and the same
prompts answered by one aggregated worker.

:mod:`.disagg_invisible` judges; this module gathers what it judges from the engines' own surfaces:

* :class:`TransferProbe` — around each request, the prefill workers' transfer histograms
  (``sglang:kv_transfer_total_mb`` / ``_latency_ms``: SGLang observes one per request a real backend
  sent) and the decode workers' checksum verifications (the ledger
  :mod:`kvalign.standins.sglang_cpu.kv_transfer` writes; the checksum itself is SGLang's);
* :func:`reference_run` — the scenario's prompts on a one-worker aggregated cluster of the same
  engine, models and page size, each answer's token ids and the worker's speculation counters.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvalign.live.cluster.lifecycle import Cluster
from kvalign.live.cluster.ports import LOOPBACK
from kvalign.live.cluster.topology import ClusterPlan, Topology
from kvalign.live.engines.sglang_cpu import checksum_ledger_path
from kvalign.live.runs import scenario
from kvalign.live.runs.disagg_invisible import DecodeRecord, TransferRecord
from kvalign.live.wire.metrics import (
    GENERATION_TOKENS,
    KV_TRANSFER_LATENCY_MS,
    KV_TRANSFER_TOTAL_MB,
    SPEC_VERIFY_CALLS,
    MetricsSnapshot,
    merge_snapshots,
    scrape,
)

#: Between scrapes while a transfer is awaited on prefill's histogram (:meth:`TransferProbe.record`).
POLL_S = 0.1

#: The extra field that makes the frontend return the engine's output token ids with the stream.
TOKEN_IDS_FIELDS = ("worker_id", "timing", "completion_token_ids")


def metrics_urls(plan: ClusterPlan, role: str) -> list[str]:
    """Each ``role`` worker's ``/metrics`` (Dynamo's system server, which serves SGLang's registry)."""
    return [f"http://{LOOPBACK}:{plan.worker_ports[w.name].system}/metrics" for w in plan.topology.by_role(role)]


class TransferProbe:
    """One :class:`TransferRecord` per request: call :meth:`start` before the first request and
    :meth:`record` after each one (requests are sequential, so each delta is that request's)."""

    def __init__(self, urls: Sequence[str], ledgers: Sequence[Path], backend: str) -> None:
        self.backend, self.urls, self.ledgers = backend, list(urls), list(ledgers)
        self._snap: MetricsSnapshot | None = None
        self._lines = 0

    @classmethod
    def of(cls, plan: ClusterPlan, backend: str) -> TransferProbe:
        """The probe of a planned cluster: its prefill workers' metrics, its decode workers' ledgers."""
        return cls(metrics_urls(plan, "prefill"), [checksum_ledger_path(plan, w) for w in plan.topology.by_role("decode")],
                   backend)

    def _scrape(self) -> MetricsSnapshot:
        return merge_snapshots(scrape(u, only=("kv_transfer",)) for u in self.urls)

    def _verifications(self) -> list[dict[str, Any]]:
        rows = []
        for path in self.ledgers:
            if path.exists():
                rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        return rows

    def start(self) -> None:
        self._snap, self._lines = self._scrape(), len(self._verifications())

    def record(self, request: int, *, wait_s: float = 0.0) -> TransferRecord:
        """The request's transfer since :meth:`start`. ``wait_s``: how long to wait (bounded, polling)
        for prefill to observe it, which SGLang does when its loop next polls the finished transfer."""
        if self._snap is None:
            raise RuntimeError("TransferProbe.record before start")
        deadline = time.monotonic() + wait_s
        snap = self._scrape()
        count = f"{KV_TRANSFER_TOTAL_MB}_count"
        while snap.total(count) <= self._snap.total(count) and time.monotonic() < deadline:
            time.sleep(POLL_S)
            snap = self._scrape()
        rows = self._verifications()
        new = rows[self._lines:]
        before, self._snap, self._lines = self._snap, snap, len(rows)

        def delta(name: str) -> float:
            return snap.total(name) - before.total(name)

        count = delta(f"{KV_TRANSFER_TOTAL_MB}_count")
        # SGLang's multiprocess registry exports a histogram only once it holds an observation: a prefill
        # that never sent a request's KV over a real backend (``fake``) exports no such family at all
        return TransferRecord(
            request, self.backend, transfers=round(count), megabytes=delta(f"{KV_TRANSFER_TOTAL_MB}_sum"),
            exported=KV_TRANSFER_TOTAL_MB in snap.types,
            latency_ms=delta(f"{KV_TRANSFER_LATENCY_MS}_sum") if count else None,
            checksums=tuple(bool(r["verified"]) for r in new), checksum_tokens=sum(int(r["tokens"]) for r in new))


def decode_record(rec: scenario.RequestRecord, before: MetricsSnapshot | None, after: MetricsSnapshot | None,
                  error: str | None = None) -> DecodeRecord:
    """One request's answer and the deltas of the decoding worker's speculation counters."""
    ids = rec.result.token_ids
    if ids is None and error is None:
        raise ValueError(f"request {rec.index + 1}: the response carried no nvext.completion_token_ids: the "
                         "output cannot be compared token by token")

    completion = rec.result.usage.get("completion_tokens")
    if ids is not None and completion is not None and len(ids) != completion:
        raise ValueError(f"request {rec.index + 1}: {len(ids)} nvext.completion_token_ids for "
                         f"usage.completion_tokens {completion}: the stream lost some")

    def delta(name: str) -> float | None:
        return None if before is None or after is None else after.total(name) - before.total(name)

    return DecodeRecord(rec.index + 1, tuple(ids or ()), delta(SPEC_VERIFY_CALLS), delta(GENERATION_TOKENS), error)


def reference_run(plan_for: Callable[[Topology, Path], tuple[ClusterPlan, Any]], *, requests: int, max_tokens: int,
                  page_size: int, run_dir: Path, startup_timeout_s: float,
                  progress: Callable[[str], None] = lambda _m: None) -> list[DecodeRecord]:
    """The scenario's prompts on one aggregated EAGLE worker planned by ``plan_for`` (the run's own
    engine kind and models): what a disaggregated cluster must answer, request by request."""
    topology = Topology.aggregated(1, eagle=True, page_size=page_size)
    plan, kind = plan_for(topology, run_dir)
    urls = metrics_urls(plan, "agg")
    out: list[DecodeRecord] = []
    with Cluster(plan, kind, startup_timeout_s=startup_timeout_s, keep_logs=True) as cluster:
        progress("aggregated reference ready: 1 worker, the same models, page size and prompts")
        prev = merge_snapshots(scrape(u) for u in urls)

        def after(rec: scenario.RequestRecord) -> None:
            nonlocal prev
            cur = merge_snapshots(scrape(u) for u in urls)
            out.append(decode_record(rec, prev, cur))
            prev = cur

        scenario.run_prefix_extension(cluster, requests, max_tokens=max_tokens, after_each=after,
                                      extra_fields=TOKEN_IDS_FIELDS)
    return out


def transfer_rows(transfers: Sequence[TransferRecord]) -> list[dict[str, Any]]:
    """The JSON form of each request's transfer."""
    return [{"request": t.request, "backend": t.backend, "transfers": t.transfers, "bytes_moved": t.bytes_moved,
             "latency_ms": t.latency_ms, "transfer_metric_exported": t.exported, "checksum_verifications": list(t.checksums),
             "checksum_verified": t.verified, "checksum_tokens": t.checksum_tokens} for t in transfers]
