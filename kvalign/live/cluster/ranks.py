"""KV-event sources per data-parallel rank: one label per (worker, rank).

A worker started with SGLang's ``--dp-size N`` runs N schedulers, each with its own KV cache and
its own KV-event stream (port ``kv_events + rank``), and Dynamo indexes and routes by
``(instance, dp_rank)``. So every place that keeps one view per stream — the captures, the lossy
hop, the fuzz's views — keys it by a *source label*: the worker's name when it has one rank (so
nothing changes without ``--dp-size``), ``<worker>.dp<r>`` otherwise.
"""

from __future__ import annotations

import re
from typing import Any

_RANKED = re.compile(r"^(?P<worker>.+)\.dp(?P<rank>\d+)$")


def source_label(worker: str, rank: int, dp_size: int) -> str:
    """The label of ``worker``'s rank ``rank`` (the bare worker name when it has one rank)."""
    return worker if dp_size == 1 else f"{worker}.dp{rank}"


def split_label(label: str) -> tuple[str, int | None]:
    """(worker name, data-parallel rank or None) of a source label."""
    m = _RANKED.match(label)
    return (label, None) if m is None else (m["worker"], int(m["rank"]))


def sources(plan: Any) -> dict[str, tuple[Any, int]]:
    """Every KV-event source of ``plan``'s publishing workers: label -> (worker spec, rank)."""
    out: dict[str, tuple[Any, int]] = {}
    for w in plan.topology.workers:
        if not w.publishes_kv_events:
            continue
        n = plan.worker_ports[w.name].kv_ranks
        for rank in range(n):
            out[source_label(w.name, rank, n)] = (w, rank)
    return out


def endpoints(plan: Any) -> dict[str, str]:
    """label -> the SGLang KV-event endpoint of that source."""
    return {label: plan.kv_events_connect(w, rank) for label, (w, rank) in sources(plan).items()}
