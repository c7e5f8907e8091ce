"""``dynamo.sglang``'s side of a data-parallel worker: the ranks it registers, the ranks it subscribes
to, and Dynamo's router over them, all on the installed release's own code.

Dynamo keys every KV source and every routing decision by ``(worker_id, dp_rank)``. What it knows of
a worker's ranks comes from two places that were wrong in turn upstream: the card registers the
routable ranks (``register.get_runtime_config`` -> ``data_parallel_start_rank`` /
``data_parallel_size``, from ``capacity.model_card_dp_rank_bounds``; rank 0 only for pure DP before
ai-dynamo/dynamo #14258), and the relay subscribes to each local rank's SGLang publisher
(``DynamoSglangPublisher.init_kv_event_publish``, over ``capacity.local_dp_rank_bounds``; one
subscriber for rank 0 before #5108). A request routed to a rank whose events were never indexed is
cache-blind (#5097, #5589, #12186, #5873). So this module calls those functions themselves on the
worker's resolved ``ServerArgs`` (``_compat.resolved_server_args``, as ``init_llm`` does) and starts:

    card (get_runtime_config) -> register_model -> relays (init_kv_event_publish, one per rank it
    picks, SGLang's ports) -> event plane -> KvRouter; KvRouter.generate -> the worker's endpoint

The served endpoint records every request the router sends (its ``routing.dp_rank``), so a check can
hold the router's choice against its own per-rank overlap. kvalign's glue is the object
``init_kv_event_publish`` runs on (the attributes it reads) and the served handler.

Negative controls: ``unsubscribed``, ``get_local_dp_rank_range`` answers rank 0 alone while the
card still registers every rank (the relay of Dynamo before #5108); ``pin-rank0``, every request
goes through ``KvRouter.generate(..., dp_rank=0)``, the router's own way of forcing a rank (a
gateway that pins rank 0 whatever the cache holds).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import math
import os
import types
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvalign.errors import MissingValue
from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.dp_sglang import LOOPBACK, DpEngine
from kvalign.oracles.registration import _Args, _dynamo_defaults

DYNAMO_FAULTS = ("unsubscribed", "pin-rank0")
MODEL = "kvalign-dp"


@dataclass
class Routed:
    """One request the router sent: the rank the worker received, the rank and credit the router reported."""

    sent_rank: int | None  # ``routing.dp_rank`` of the request the endpoint received
    reported_rank: int | None  # ``routing_data.worker_id.decode_dp_rank`` of the router's answer
    kv_hit_rate: float | None


@contextlib.contextmanager
def _patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _dynamo_sglang() -> types.SimpleNamespace:
    try:
        mods = {name: importlib.import_module(f"dynamo.sglang.{name}")
                for name in ("register", "publisher", "capacity", "args", "_compat")}
    except Exception as exc:  # an import chain this long fails in many ways; report the root
        raise OracleUnavailable(f"dynamo.sglang does not import here ({type(exc).__name__}: {exc})") from None
    for mod, name in (("publisher", "DynamoSglangPublisher"), ("publisher", "get_local_dp_rank_range"),
                      ("register", "get_runtime_config"), ("capacity", "kv_event_block_size"),
                      ("_compat", "resolved_server_args")):
        if not hasattr(mods[mod], name):
            raise OracleUnavailable(f"dynamo.sglang.{mod} has no {name}: this release places DP ranks another way")
    return types.SimpleNamespace(**mods)


@dataclass
class DpWorker:
    """One registered ``dynamo.sglang`` worker over ``engine``'s schedulers, with a router over it."""

    path: Any  # kvalign.oracles.router_path.RouterPath: the in-process runtime
    engine: DpEngine
    fault: str | None = None
    registered: range = range(0)
    #: dp_rank -> the SGLang endpoint each relay ``init_kv_event_publish`` built subscribes to
    subscribed: dict[int, str] = field(default_factory=dict)
    block_size: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    worker_id: int | None = None
    _relays: list[Any] = field(default_factory=list)
    _router: Any = None
    _serving: Any = None
    _names = itertools.count()

    def __post_init__(self) -> None:
        if self.fault is not None and self.fault not in DYNAMO_FAULTS:
            raise ValueError(f"unknown Dynamo DP fault {self.fault!r}; expected one of {DYNAMO_FAULTS}")
        self.ds = _dynamo_sglang()
        self.view = self.ds._compat.resolved_server_args(self.engine.server_args)
        self.block_size = int(self.ds.capacity.kv_event_block_size(self.view))
        self.path.event_plane()  # its relays and router on an event plane of their own: no other worker's events
        try:
            self.path.call(self._start)
        except (OracleUnavailable, MissingValue):
            raise
        except Exception as exc:
            raise OracleUnavailable(f"dynamo.sglang cannot start a {self.engine.layout.describe()} worker: "
                                    f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None

    async def _handler(self, request: dict[str, Any], context: Any) -> Any:
        self.requests.append(request)
        yield {"token_ids": [0], "finish_reason": "stop"}

    async def _start(self) -> None:
        c, ds = self.path.core, self.ds
        endpoint = self.path.runtime.endpoint(f"kvalign-dp-{self.engine.layout.name}-{next(self._names)}.backend.generate")
        dynamo_args = _Args(_dynamo_defaults(ds.args), use_kv_events=True, enable_multimodal=False)
        logging.disable(logging.WARNING)  # the registration logs why it skips engine-only fields
        try:
            card = await ds.register.get_runtime_config(None, self.view, dynamo_args)
        finally:
            logging.disable(logging.NOTSET)
        if card is None:
            raise OracleUnavailable("dynamo.sglang.register.get_runtime_config returned no card")
        self.registered = registered_ranks(card)
        await c.register_model(c.ModelInput.Tokens, c.ModelType.TensorBased, endpoint, MODEL,
                               kv_cache_block_size=self.block_size, runtime_config=card,
                               worker_type=c.WorkerType.Aggregated)
        self._serving = asyncio.ensure_future(endpoint.serve_endpoint(self._handler, graceful_shutdown=False))
        await asyncio.sleep(0.2)  # the instance is registered before the relays name it
        self.worker_id = int(endpoint.connection_id())
        me = types.SimpleNamespace(dynamo_args=dynamo_args, server_args=self.view, generate_endpoint=endpoint,
                                   kv_worker_id=None, kv_publishers=[], kv_publisher=None)
        built = ds.publisher.KvEventPublisher

        def relay(*args: Any, **kwargs: Any) -> Any:  # observe what Dynamo subscribes to, build it unchanged
            self.subscribed[int(kwargs.get("dp_rank", 0))] = str(kwargs.get("zmq_endpoint"))
            return built(*args, **kwargs)

        ranks = ds.publisher.get_local_dp_rank_range
        only_first = (lambda server_args: range(ranks(server_args).start, ranks(server_args).start + 1))
        with _patched(ds.publisher, "KvEventPublisher", relay), _env(SGLANG_HOST_IP=LOOPBACK, HOST_IP=LOOPBACK), \
                (_patched(ds.publisher, "get_local_dp_rank_range", only_first) if self.fault == "unsubscribed"
                 else contextlib.nullcontext()):
            self._relays = list(ds.publisher.DynamoSglangPublisher.init_kv_event_publish(me))
        self._router = c.KvRouter(endpoint, self.block_size, c.KvRouterConfig(use_kv_events=True))

    def scores(self, tokens: Sequence[int]) -> dict[int, int]:
        """The router's device-tier overlap (blocks) on each of this worker's ranks, as it reports them."""
        answer = self.path.call(self._router.get_overlap_scores, list(tokens))
        return {int(row["dp_rank"]): int(row["device_blocks"]) for row in answer["workers"]
                if int(row["worker_id"]) == self.worker_id}

    def route(self, tokens: Sequence[int]) -> Routed:
        """Send ``tokens`` through ``KvRouter.generate``: the request the worker received and the router's report."""
        before = len(self.requests)

        async def generate() -> list[Any]:
            pin = {"worker_id": self.worker_id, "dp_rank": 0} if self.fault == "pin-rank0" else {}
            return [x async for x in await self._router.generate(list(tokens), MODEL, **pin)]

        out = self.path.call(generate)
        sent = self.requests[before] if len(self.requests) > before else {}
        data = next((o.get("routing_data") for o in out if isinstance(o, dict) and o.get("routing_data")), None) or {}
        wid, timing = data.get("worker_id") or {}, data.get("timing") or {}
        rank = (sent.get("routing") or {}).get("dp_rank")
        return Routed(None if rank is None else int(rank),
                      wid.get("decode_dp_rank", wid.get("prefill_dp_rank")), timing.get("kv_hit_rate"))

    def close(self) -> None:
        if self._serving is not None:
            self.path._loop.call_soon_threadsafe(self._serving.cancel)
        self._relays.clear()


def registered_ranks(card: Any) -> range:
    """The ranks a worker's card registers for routing. A card without ``data_parallel_size`` is an error
    naming it: read as 1, it would fabricate DP_RANK_UNREGISTERED for every other rank SGLang runs."""
    size = getattr(card, "data_parallel_size", None)
    if size is None:
        raise MissingValue("data_parallel_size", "the card dynamo.sglang's get_runtime_config built")
    start = getattr(card, "data_parallel_start_rank", None)
    return range(int(start or 0), int(start or 0) + int(size))


def credited_blocks(rate: float | None, tokens: int, block_size: int) -> int | None:
    """The blocks a ``kv_hit_rate`` stands for: the one k with ``k / ceil(N/B) == rate`` (None if none)."""
    if rate is None:
        return None
    total = max(math.ceil(tokens / block_size), 1)
    k = round(rate * total)
    return k if 0 <= k <= total and k / total == rate else None

