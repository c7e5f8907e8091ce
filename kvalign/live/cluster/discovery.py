"""Read Dynamo's discovery store: which instances exist, and what each registered.

With ``DYN_DISCOVERY_BACKEND=file`` every registration is one JSON file under
``$DYN_FILE_KV/v1/<bucket>/<url-encoded key>``; with ``etcd`` it is one key
``v1/<bucket>/<namespace>/<component>/<endpoint>/<instance id hex>`` holding the same JSON
(checked against ai-dynamo-runtime 1.6.1 with etcd 3.4.23), read here through etcd's v3 JSON
gateway (``POST /v3/kv/range``) so no etcd client library is needed. A store is a directory
(file backend) or an :class:`EtcdStore`. Reading it is how the harness learns, for any
worker kind and without scraping logs, (a) a worker's Dynamo instance id — matched by the
request-plane port the harness pinned with ``DYN_TCP_RPC_PORT`` — and (b) the model card the
router will use for that worker: ``kv_cache_block_size`` and ``runtime_config.enable_eagle``,
the two flags whose mismatch makes routing cache-blind.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import requests


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


@dataclass(frozen=True)
class EtcdStore:
    """Dynamo's etcd discovery store at ``endpoint`` (``ETCD_ENDPOINTS``, one URL)."""

    endpoint: str
    timeout_s: float = 2.0

    def records(self, bucket: str) -> list[dict[str, Any]]:
        """Every JSON value under ``v1/<bucket>/``; an unreachable etcd reads as empty (polled)."""
        prefix = f"v1/{bucket}/".encode()
        end = prefix[:-1] + bytes([prefix[-1] + 1])  # etcd's "every key with this prefix"
        body = {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()}
        try:
            resp = requests.post(f"{self.endpoint.rstrip('/')}/v3/kv/range", json=body, timeout=self.timeout_s)
            resp.raise_for_status()
            kvs = resp.json().get("kvs", [])
        except (requests.RequestException, ValueError):
            return []
        out = []
        for kv in sorted(kvs, key=lambda kv: kv.get("key", "")):
            try:
                out.append(json.loads(base64.b64decode(kv["value"])))
            except (KeyError, ValueError):
                continue
        return out

    def healthy(self) -> bool:
        """etcd's own ``/health`` says the member serves (readiness before Dynamo starts)."""
        try:
            return requests.get(f"{self.endpoint.rstrip('/')}/health", timeout=self.timeout_s).json().get("health") == "true"
        except (requests.RequestException, ValueError, AttributeError):
            return False


#: Where discovery lives: the ``DYN_FILE_KV`` directory or an etcd store.
Store = Union[str, Path, EtcdStore]


def _records(store: Store, bucket: str) -> list[dict[str, Any]]:
    if isinstance(store, EtcdStore):
        return store.records(bucket)
    out = []
    d = Path(store) / "v1" / bucket
    if not d.is_dir():
        return out
    for f in sorted(d.iterdir()):
        try:
            out.append(json.loads(f.read_text()))
        except (OSError, ValueError):
            continue  # a file being replaced right now; the next poll sees it whole
    return out


def instances(store: Store) -> list[Instance]:
    """All registered endpoint instances with a tcp transport."""
    res = []
    for r in _records(store, "instances"):
        tcp = (r.get("transport") or {}).get("tcp")
        if r.get("type") != "Endpoint" or not isinstance(tcp, str):
            continue
        res.append(Instance(int(r["instance_id"]), r["namespace"], r["component"], r["endpoint"], tcp.split("/", 1)[0]))
    return res


def cards(store: Store) -> list[Card]:
    """All registered model cards."""
    res = []
    for r in _records(store, "mdc"):
        card = r.get("card_json") or {}
        rc = card.get("runtime_config") or {}
        res.append(Card(
            int(r["instance_id"]), r.get("component", ""), card.get("display_name", ""),
            str(card.get("worker_type", "")), int(card.get("kv_cache_block_size") or 0),
            bool(rc.get("enable_eagle", False)), card,
        ))
    return res


def instance_on_port(store: Store, port: int, *, endpoint: str = "generate") -> Instance | None:
    """The ``endpoint`` instance served on request-plane ``port``, if registered yet."""
    for inst in instances(store):
        if inst.endpoint == endpoint and inst.port == port:
            return inst
    return None


def card_for(store: Store, instance_id: int) -> Card | None:
    for c in cards(store):
        if c.instance_id == instance_id:
            return c
    return None
