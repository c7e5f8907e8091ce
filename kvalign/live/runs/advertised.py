"""The ``advertised`` property on a live cluster: what each worker registered, advertised and published.

The unit property (:mod:`kvalign.verify.props.advertised.body`) computes each side's number with its own code
outside an engine; here the running workers say it themselves, per publishing worker:

* the ``kv_cache_block_size`` of the model card ``dynamo.sglang`` registered (Dynamo's discovery store);
* the ``kv_events.block_size`` SGLang's ``/server_info`` would advertise, computed in the worker by
  SGLang's own ``describe_kv_events_publisher`` on the engine's arguments once it resolved them
  (:func:`kvalign.live.engines.sglang_worker.record_server_info`);
* the ``block_size`` of every ``BlockStored`` the worker published (the cluster's capture of SGLang's
  own stream).

A worker that published no page (a short replay that never routed to it) has nothing to compare on
the event side: its row is ok but ``checked`` false, and says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from kvalign.live.cluster import discovery
from kvalign.model.causes import Cause
from kvalign.model.events import BlockStored


@dataclass(frozen=True)
class AdvertisedRow:
    """One worker's block sizes, live."""

    worker: str
    launch_page_size: int
    registered: int | None
    advertised: int | None
    emitted: list[int]
    cause: str | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.cause is None

    @property
    def checked(self) -> bool:
        """Whether the events said anything: a worker that published no page compares nothing."""
        return bool(self.emitted)

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "checked": self.checked}


def _server_info(path: Any) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def advertised_rows(cluster: Any) -> list[AdvertisedRow]:
    """A row per publishing worker of a running real-engine ``cluster`` (one with a capture)."""
    from kvalign.live.engines.sglang_cpu import server_info_path

    plan = cluster.plan
    rows = []
    for name, handle in cluster.workers.items():
        if not handle.spec.publishes_kv_events:
            continue
        card = discovery.card_for(plan.discovery_store, handle.instance_id)
        info = _server_info(server_info_path(plan, handle.spec))
        descriptor = (info or {}).get("kv_events") or {}
        emitted = sorted({ev.block_size for c in cluster.capture.snapshot() if c.label == name
                          for ev in c.batch.events if isinstance(ev, BlockStored)})
        registered = card.kv_cache_block_size if card else None
        advertised = descriptor.get("block_size")
        row = AdvertisedRow(name, plan.topology.page_size, registered, advertised, emitted)
        said = (f"{name} (--page-size {plan.topology.page_size}): dynamo.sglang registered kv_cache_block_size "
                f"{registered}, SGLang's /server_info advertises {advertised}, its events carry block_size "
                f"{', '.join(map(str, emitted)) or 'nothing yet'}")
        if info is None or card is None:
            row = AdvertisedRow(**{**asdict(row), "cause": "UNAVAILABLE",
                                   "detail": said + " (the worker recorded no /server_info descriptor)" if info is None
                                   else said + " (no model card in discovery)"})
        elif not emitted:
            row = AdvertisedRow(**{**asdict(row), "detail": said + " (it published no page: nothing to compare)"})
        elif set(emitted) != {registered}:
            row = AdvertisedRow(**{**asdict(row), "cause": Cause.REGISTERED_BLOCK_SIZE.name, "detail": said})
        elif advertised != registered:
            row = AdvertisedRow(**{**asdict(row), "cause": Cause.ADVERTISED_BLOCK_SIZE.name, "detail": said})
        else:
            row = AdvertisedRow(**{**asdict(row), "detail": said})
        rows.append(row)
    return rows
