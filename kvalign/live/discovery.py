"""Read Dynamo's file-backed discovery store: which instances exist, and what each registered.

With ``DYN_DISCOVERY_BACKEND=file`` every registration is one JSON file under
``$DYN_FILE_KV/v1/<bucket>/<url-encoded key>``. Reading it is how the harness learns, for any
worker kind and without scraping logs, (a) a worker's Dynamo instance id — matched by the
request-plane port the harness pinned with ``DYN_TCP_RPC_PORT`` — and (b) the model card the
router will use for that worker: ``kv_cache_block_size`` and ``runtime_config.enable_eagle``,
the two flags whose mismatch makes routing cache-blind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Instance:
    """One served endpoint instance (``v1/instances``)."""

    instance_id: int
    namespace: str
    component: str
    endpoint: str
    address: str  # "host:port" of the tcp request plane

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


@dataclass(frozen=True)
class Card:
    """The model deployment card one instance registered (``v1/mdc``)."""

    instance_id: int
    component: str
    model_name: str
    worker_type: str
    kv_cache_block_size: int
    enable_eagle: bool
    raw: dict[str, Any]


def _records(root: Path, bucket: str) -> list[dict[str, Any]]:
    out = []
    d = root / "v1" / bucket
    if not d.is_dir():
        return out
    for f in sorted(d.iterdir()):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue  # a file being replaced right now; the next poll sees it whole
    return out


def instances(file_kv: str | Path) -> list[Instance]:
    """All registered endpoint instances with a tcp transport."""
    res = []
    for r in _records(Path(file_kv), "instances"):
        tcp = (r.get("transport") or {}).get("tcp")
        if r.get("type") != "Endpoint" or not isinstance(tcp, str):
            continue
        res.append(Instance(int(r["instance_id"]), r["namespace"], r["component"], r["endpoint"], tcp.split("/", 1)[0]))
    return res


def cards(file_kv: str | Path) -> list[Card]:
    """All registered model cards."""
    res = []
    for r in _records(Path(file_kv), "mdc"):
        card = r.get("card_json") or {}
        rc = card.get("runtime_config") or {}
        res.append(Card(
            int(r["instance_id"]), r.get("component", ""), card.get("display_name", ""),
            str(card.get("worker_type", "")), int(card.get("kv_cache_block_size") or 0),
            bool(rc.get("enable_eagle", False)), card,
        ))
    return res


def instance_on_port(file_kv: str | Path, port: int, *, endpoint: str = "generate") -> Instance | None:
    """The ``endpoint`` instance served on request-plane ``port``, if registered yet."""
    for inst in instances(file_kv):
        if inst.endpoint == endpoint and inst.port == port:
            return inst
    return None


def card_for(file_kv: str | Path, instance_id: int) -> Card | None:
    for c in cards(file_kv):
        if c.instance_id == instance_id:
            return c
    return None
