"""The real worker-to-router path of a Dynamo + SGLang deployment, in one process, on loopback.

``dynamo.sglang`` never hands SGLang's KV events to Python: it builds a Rust ``KvEventPublisher``
that subscribes to SGLang's ZMQ publisher, decodes each batch, re-hashes every page and forwards
the router events over Dynamo's event plane to every ``KvRouter``, whose index then answers
overlap queries. That relay is where #5096 (bigram token_ids not understood) and #14530 (a
metadata map such as ``cache_salt`` failing to decode, dropping the whole batch) lived, so the
``ingest`` property drives exactly it:

    SGLang radix cache -> SGLang ZmqEventPublisher (tcp://127.0.0.1) -> Dynamo KvEventPublisher
    (worker relay) -> event plane (ZMQ, through a loopback XSUB/XPUB broker per worker) -> KvRouter index

Nothing here is kvalign's model of Dynamo; the only kvalign code on the path is the glue that
starts the pieces the way ``dynamo.sglang`` does (``enable_local_indexer`` as its default, card
``enable_eagle`` as a correct registration would set it). Releases differ in constructor
arguments, env names and card fields, so each call adapts to what the installed binding
accepts; a field a release lacks is reported through :attr:`RouterPath.missing`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import faulthandler
import importlib.metadata
import inspect
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvalign.oracles.base import OracleUnavailable

LOOPBACK = "127.0.0.1"
#: Seconds one binding call may take (they take milliseconds).
CALL_TIMEOUT_S = 30.0
#: Seconds after which a call that has not come back means the *process* is deadlocked, not just the
#: loop: 1.0.2's ``KvRouter`` constructor can block the loop thread while holding the GIL, waiting on
#: the binding's own threads, which wait for the GIL; then not even the caller's timeout can run.
#: faulthandler's watchdog (a C thread, no GIL) then writes every thread's stack to stderr and exits
#: the process with status 1, instead of leaving it hung; :data:`STUCK_MARK` starts what it writes.
STUCK_EXIT_S = 90.0
STUCK_MARK = "Timeout ("
#: How long to wait for a published batch to show up in the router's index.
INGEST_TIMEOUT_S = 4.0
#: A barrier polls the router's index after this long, then twice as long each time up to POLL_MAX_S: a
#: batch on loopback is indexed within a few milliseconds, and a fixed 20 ms poll made the barriers
#: (two per ingest example) most of an ingest row's wall time.
POLL_FIRST_S, POLL_MAX_S = 0.001, 0.02
#: Width of one example's token range (kvalign's strategies draw ingest tokens from a vocabulary of 4).
TOKEN_SPACE = 16
#: Token ranges one ``check`` job may take (:meth:`RouterPath.start_range`): 2**19 examples, so 200 jobs stay
#: below 2**31 token ids, far under the sentinels'.
RANGES_PER_BLOCK = 1 << 19
#: Releases before this one recover a worker's whole tree when their router discovers it, after the first
#: examples began (:meth:`RouterPath.await_recovery`); later ones restore differently and are left as they are.
RECOVERY_SYNC_BEFORE = (1, 1)
#: Sentinel pages use token ids from here up (kvalign's strategies draw from a tiny vocabulary); each
#: sentinel gets its own id, since the router keeps one node per (parent, local hash).
SENTINEL_BASE = 0xF000_0000


def sentinel_hash(k: int) -> int:
    """Engine hash of the k-th sentinel page (distinct from SGLang's SHA-256-derived hashes in practice)."""
    return (1 << 62) + k


def configured_host_weight(core: Any) -> float:
    """``KvRouterConfig``'s ``host_cache_hit_weight`` default, read from the installed binding's signature
    (the binding exposes no getter for it)."""
    import re

    found = re.search(r"host_cache_hit_weight=([0-9.]+)", getattr(core.KvRouterConfig, "__text_signature__", None) or "")
    if found is None:
        raise OracleUnavailable("this Dynamo's KvRouterConfig has no host_cache_hit_weight (its router weighs no host tier)")
    return float(found.group(1))


def configured_disk_weight(core: Any) -> float:
    """``KvRouterConfig``'s ``disk_cache_hit_weight`` default (``--router-disk-cache-hit-weight``), read from the
    installed binding's signature as :func:`configured_host_weight` reads the host weight."""
    import re

    found = re.search(r"disk_cache_hit_weight=([0-9.]+)", getattr(core.KvRouterConfig, "__text_signature__", None) or "")
    if found is None:
        raise OracleUnavailable("this Dynamo's KvRouterConfig has no disk_cache_hit_weight (its router weighs no disk tier)")
    return float(found.group(1))


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:3] if x.isdigit())


def runtime_env(dynamo_version: str, broker_url: str) -> dict[str, str]:
    """Env for an in-process runtime: every Dynamo listener on loopback, ZMQ event plane via the broker.

    Before 1.6 ``DYN_TCP_RESPONSE_STREAM_HOST`` names an *interface* ("Interface not found:
    127.0.0.1" otherwise), so older releases get ``lo``.
    """
    modern = _version_tuple(dynamo_version) >= (1, 6)
    return {
        "DYN_TCP_RPC_HOST": LOOPBACK,
        "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK if modern else "lo",
        "DYN_SYSTEM_HOST": LOOPBACK,
        "DYN_EVENT_PLANE": "zmq",
        "DYN_ZMQ_BROKER_URL": broker_url,
        "DYN_ROUTER_MIN_INITIAL_WORKERS": "0",
        "DYN_LOG": os.environ.get("DYN_LOG", "error"),
    }


Transform = Callable[[list[bytes]], "list[bytes] | None"]


class LoopbackProxy:
    """An XSUB/XPUB proxy bound on 127.0.0.1 (publishers connect to ``xsub``, subscribers to ``xpub``).

    Two uses: Dynamo's event-plane broker (so no event-plane socket binds 0.0.0.0), and the hop
    between SGLang's publisher and Dynamo's relay (SGLang *connects* to a concrete host, in every
    version, so nothing binds a wildcard). ``transform`` may rewrite or drop (None) each
    published multipart message: only the negative controls use it, to stand in for a broken relay.
    """

    def __init__(self, transform: Transform | None = None) -> None:
        self.transform = transform
        #: while set, published messages are dropped here (subscriptions still travel): :meth:`RouterPath.await_recovery`
        self.withheld = False
        self._ctx = zmq.Context()
        self._xsub, self._xpub = self._ctx.socket(zmq.XSUB), self._ctx.socket(zmq.XPUB)
        for s in (self._xsub, self._xpub):
            s.setsockopt(zmq.LINGER, 0)
        self.xsub = f"tcp://{LOOPBACK}:{self._xsub.bind_to_random_port(f'tcp://{LOOPBACK}')}"
        self.xpub = f"tcp://{LOOPBACK}:{self._xpub.bind_to_random_port(f'tcp://{LOOPBACK}')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvalign-zmq-proxy")
        self._thread.start()

    @property
    def url(self) -> str:
        """The ``DYN_ZMQ_BROKER_URL`` value for this proxy."""
        return f"xsub={self.xsub} , xpub={self.xpub}"

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._xsub, zmq.POLLIN)
        poller.register(self._xpub, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self._xpub:  # subscriptions travel upstream unchanged
                    self._xsub.send_multipart(self._xpub.recv_multipart())
                    continue
                frames = self._xsub.recv_multipart()
                if self.transform is not None:
                    frames = self.transform(frames)
                if frames is not None and not self.withheld:
                    self._xpub.send_multipart(frames)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._xsub.close(linger=0)
        self._xpub.close(linger=0)
        self._ctx.term()


class SglangPublisher:
    """SGLang's real ``ZmqEventPublisher`` bound on 127.0.0.1 (as a scheduler with kv_events_config)."""

    def __init__(self, transform: Transform | None = None, attn_dp_rank: int = 0) -> None:
        """``attn_dp_rank``: the rank every batch is tagged with, as a data-parallel rank's scheduler tags its own
        (set on the batch: the publisher's own rank would also move its endpoint's port by that rank)."""
        from kvalign.oracles.sglang import _modules

        _modules()  # the torchvision shim and SGLang's import chain, with an install hint on failure
        try:
            import sglang.srt.disaggregation.kv_events as kv
        except ImportError as exc:
            raise OracleUnavailable(f"SGLang's KV-event publisher is not importable ({exc})") from None
        self.kv = kv
        self.hop = LoopbackProxy(transform)
        #: where the relay subscribes (SGLang's publisher connects to the hop's other side)
        self.endpoint = self.hop.xpub
        config = {"publisher": "zmq", "topic": "kv-events", "endpoint": self.hop.xsub}
        self._pub = kv.EventPublisherFactory.create(json.dumps(config), attn_dp_rank=0)
        self._rank = {"attn_dp_rank": attn_dp_rank} if attn_dp_rank else {}

    def publish(self, events: Sequence[Any]) -> None:
        self._pub.publish(self.kv.KVEventBatch(ts=time.time(), events=list(events), **self._rank))

    def sentinel(self, k: int, page_size: int) -> Any:
        """The k-th one-page plain ``BlockStored`` off the root (SGLang's own class): an ingestion barrier."""
        return self.kv.BlockStored(block_hashes=[sentinel_hash(k)], parent_block_hash=None,
                                   token_ids=[SENTINEL_BASE + k] * page_size, block_size=page_size,
                                   lora_id=None, medium="GPU")

    def clear(self) -> Any:
        return self.kv.AllBlocksCleared()

    def close(self) -> None:
        from kvalign.oracles.sglang import shutdown_publisher

        shutdown_publisher(self._pub)
        self.hop.close()


@dataclass
class IngestWorker:
    """One registered worker (card + relay on its SGLang publisher) and the router over it."""

    path: RouterPath
    block_size: int
    eagle: bool
    publisher: SglangPublisher
    router: Any
    relay: Any
    #: the event plane its relay publishes on and its router subscribes to (:meth:`RouterPath.event_plane`)
    plane: LoopbackProxy
    _sentinels: Any = field(default_factory=lambda: itertools.count(1))
    _space: int = 0
    #: the relay indexed a sentinel at least once / then stopped indexing altogether
    indexed_once: bool = False
    dead: bool = False

    def dump(self) -> list[tuple[int | None, int, int]]:
        """``(parent, engine block hash, router local hash)`` for every block the router indexed."""
        out = []
        for entry in json.loads(self.path.call(self.router.dump_events)):
            stored = entry["event"]["data"].get("stored") if isinstance(entry["event"]["data"], dict) else None
            if not stored:
                continue
            parent = stored.get("parent_hash")
            for b in stored["blocks"]:
                out.append((parent, int(b["block_hash"]), int(b["tokens_hash"])))
                parent = b["block_hash"]
        return out

    def dump_tiers(self) -> list[tuple[str | None, int]]:
        """``(storage tier, engine block hash)`` for every block the router indexed, in any tier
        (``device``, ``host_pinned``, ``disk``; None from a release that does not say)."""
        out = []
        for entry in json.loads(self.path.call(self.router.dump_events)):
            stored = entry["event"]["data"].get("stored") if isinstance(entry["event"]["data"], dict) else None
            if stored:
                out.extend((entry.get("storage_tier"), int(b["block_hash"])) for b in stored["blocks"])
        return out

    def barrier(self) -> bool:
        """Publish a sentinel page and wait until the router indexed it (so everything before it was
        processed: one stream, one relay, in order). False when it never arrives."""
        if self.dead:  # it failed a barrier once; do not wait on it again for every example
            return False
        k = next(self._sentinels)
        engine_hash = sentinel_hash(k)
        deadline = time.monotonic() + INGEST_TIMEOUT_S
        sent_at, pause = 0.0, POLL_FIRST_S
        while time.monotonic() < deadline:
            if time.monotonic() - sent_at > 0.5:  # re-send: the first ones may precede the subscription
                self.publisher.publish([self.publisher.sentinel(k, self.block_size)])
                sent_at = time.monotonic()
            time.sleep(pause)
            pause = min(pause * 2, POLL_MAX_S)
            if any(h == engine_hash for _p, h, _t in self.dump()):
                self.indexed_once = True
                return True
        self.dead = True  # whether it ever indexed (indexed_once) tells a dead relay from one that never ran
        return False

    def token_space(self) -> int:
        """A fresh token-id offset for one example.

        The router's index is never emptied between examples: a release that ignored
        AllBlocksCleared would otherwise carry one example's blocks into the next. Shifting each
        example's tokens into its own range makes earlier blocks unreachable instead, and the
        example's own clears and removals are still checked (``ingest``'s stale-block diagnosis).
        """
        self._space += 1
        return self.path.space_base + self._space * TOKEN_SPACE

    def overlap(self, tokens: Sequence[int], lora_name: str | None, cache_namespace: str | None) -> int:
        """The router's own overlap answer (device blocks) for a query, with this release's query API."""
        return self.path.query_overlap(self.router, list(tokens), lora_name, cache_namespace)


def worker_path(name: str) -> str:
    """The endpoint a worker of model ``name`` registers (a namespace of its own)."""
    return f"kvalign-{name}.worker.generate"


async def register_relay(core: Any, runtime: Any, name: str, block_size: int, eagle: bool, zmq_endpoint: str,
                         missing: set[str]) -> tuple[Any, Any]:
    """Register a worker of model ``name`` at ``kvalign-{name}.worker.generate`` with the card a correct registration sets,
    and start its relay on SGLang's publisher at ``zmq_endpoint``: (endpoint, relay). A card field the
    release lacks is added to ``missing``. The in-process path and a relay's own process
    (:mod:`kvalign.oracles.relay_process`) both register this way."""
    card = core.ModelRuntimeConfig()
    for field_name, value in (("enable_eagle", eagle), ("kv_event_publishing_enabled", True),
                              ("enable_local_indexer", True)):
        try:  # enable_eagle: what a correct registration sets (the card property checks that)
            setattr(card, field_name, value)
        except AttributeError:
            missing.add(f"ModelRuntimeConfig.{field_name}")
    # One namespace per worker: some releases (1.3.x) scope a router's event subscription to the
    # namespace, so two workers in one namespace would feed each other's routers.
    endpoint = runtime.endpoint(worker_path(name))
    kw: dict[str, Any] = {"kv_cache_block_size": block_size, "runtime_config": card}
    if hasattr(core, "WorkerType"):
        kw["worker_type"] = core.WorkerType.Aggregated
    await core.register_model(core.ModelInput.Tensor, core.ModelType.TensorBased, endpoint, name, **kw)
    await endpoint.register_endpoint_instance()
    # As dynamo.sglang builds it: kv_block_size = page size, topic "", local indexer on (its default).
    relay = core.KvEventPublisher(endpoint, kv_block_size=block_size, zmq_endpoint=zmq_endpoint, zmq_topic="",
                                  enable_local_indexer=True)
    return endpoint, relay


class RouterPath:
    """The installed Dynamo's runtime, one worker + ``KvRouter`` per (block size, eagle), on loopback."""

    def __init__(self, transform: Transform | None = None) -> None:
        """``transform``: applied to every SGLang message on its way to the relay (negative controls only)."""
        self.transform = transform
        try:
            self.version = importlib.metadata.version("ai-dynamo-runtime")
        except importlib.metadata.PackageNotFoundError:
            raise OracleUnavailable("ai-dynamo-runtime is not installed: run scripts/setup.sh") from None
        self.broker = LoopbackProxy()
        env = {**runtime_env(self.version, self.broker.url), **self._extra_env()}
        self._saved_env = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            from dynamo import _core
        except ImportError as exc:
            self._restore()
            raise OracleUnavailable(f"cannot import dynamo._core ({exc})") from None
        self.core = _core
        #: capabilities this release lacks on the path (card fields, query kwargs), for reports
        self.missing: set[str] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="kvalign-router-path")
        self._thread.start()
        self._workers: dict[tuple[int, bool], IngestWorker] = {}
        #: every call under the STUCK_EXIT_S watchdog, not only the runtime's and a worker's start: the
        #: deadlock it is for was seen on 1.0.x, and arming it costs about 1 ms a call (cancelling joins its
        #: thread), which was a third of a servable row's wall time on 1.6.1
        self._watched = _version_tuple(self.version) < (1, 1)
        #: where this run's token ranges start (:meth:`start_range`)
        self.space_base = 0
        self._retired: list[IngestWorker] = []
        #: every worker's event plane (:meth:`event_plane`), closed after the runtime
        self._planes: list[LoopbackProxy] = []
        #: (block size, eagle) keys whose worker was already replaced once (never again: a relay that
        #: stops twice is a finding, and waiting on it for every example would only cost time)
        self.refreshed: set[tuple[int, bool]] = set()
        #: why the in-process runtime is unusable (a call that never returned: 1.3.1's and 1.0.2's KvRouter
        #: can block its event loop), so every later call fails at once instead of each waiting CALL_TIMEOUT_S
        self.wedged: str | None = None
        try:
            self.runtime = self.call(self._start)
        except BaseException:
            self._stop_loop()
            self._restore()
            raise

    def _extra_env(self) -> dict[str, str]:
        """Environment a subclass adds to :func:`runtime_env` (another discovery backend)."""
        return {}

    async def _start(self) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return self.core.DistributedRuntime(loop, "mem", "tcp", event_plane="zmq")
        except TypeError:  # before the event_plane keyword: DYN_EVENT_PLANE decides
            return self.core.DistributedRuntime(loop, "mem", "tcp", False)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` on the runtime's loop (the binding's coroutines must be created there).

        A call that does not return within ``CALL_TIMEOUT_S`` means the loop itself is stuck (seen:
        1.0.2's ``KvRouter`` constructor blocking it while the binding's own threads wait to post to
        it), so the path is *wedged*: this call and every later one raise :class:`OracleUnavailable`
        at once. Waiting again per call is what once made a pair's check run past 600 s, Hypothesis
        shrinking an example whose every query waited 30 s for a loop that would never answer.
        """
        if self.wedged:
            raise OracleUnavailable(self.wedged)

        async def invoke() -> Any:
            result = fn(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        watched = self._watched or fn in (self._start, self._new_worker)
        if watched:
            faulthandler.dump_traceback_later(STUCK_EXIT_S, exit=True)
        try:
            return asyncio.run_coroutine_threadsafe(invoke(), self._loop).result(timeout=CALL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
            self.wedged = (f"Dynamo {self.version}'s runtime event loop did not return from {name} within "
                           f"{CALL_TIMEOUT_S:.0f} s (the in-process relay / router path is stuck)")
            raise OracleUnavailable(self.wedged) from None
        finally:
            if watched:
                faulthandler.cancel_dump_traceback_later()

    async def _new_worker(self, block_size: int, eagle: bool, zmq_endpoint: str) -> tuple[Any, Any]:
        c = self.core
        name = f"ingest-b{block_size}-{'eagle' if eagle else 'plain'}-{len(self._retired)}"
        endpoint, relay = await register_relay(c, self.runtime, name, block_size, eagle, zmq_endpoint, self.missing)
        # Let the binding's threads finish handing results back to this loop (call_soon_threadsafe
        # needs the GIL) before a constructor that can block this thread while holding it: the
        # deadlock of both stuck 1.0.2 checks had two of them inside call_soon_threadsafe
        # (STUCK_EXIT_S), and a 1.3.1 check re-registering a worker whose relay had stopped had the same
        # two (2026-12-07). Every release pays the 0.1 s, once per worker.
        await asyncio.sleep(0.1)
        router = c.KvRouter(endpoint, block_size, c.KvRouterConfig(use_kv_events=True))
        return relay, router

    def event_plane(self) -> LoopbackProxy:
        """A new event-plane broker, made the one that the next relay and router built on this runtime use.

        Every worker of one in-process runtime has the same worker id (the runtime's), and Dynamo 1.0.2's relays
        publish on the one topic ``kv-events`` whatever their namespace, so on a shared broker each router indexed
        every other worker's blocks as its own worker's: two workers of the same page size (a plain and an EAGLE
        row) each credited the other's stored pages (probe, 2026-12-07), and since the rows' examples take the
        same token ranges, which rows ran before decided what a row's router held. A deployment's workers are
        distinct to the router; a broker per worker makes them so here. The binding reads
        ``DYN_ZMQ_BROKER_URL`` when a relay or router is built (checked on 1.0.2), so the variable is set
        here and stays until the next worker's; :meth:`close` restores it and closes the brokers."""
        plane = LoopbackProxy()
        self._planes.append(plane)
        os.environ["DYN_ZMQ_BROKER_URL"] = plane.url
        return plane

    def start_range(self, k: int) -> None:
        """Hand the next examples token ranges of their own, the ``k``-th block of :data:`RANGES_PER_BLOCK`.

        ``check`` starts block ``k`` for its ``k``-th job, so a job's tokens are the same whichever worker
        process runs it and whatever ran there before (SGLang's eviction among pages of equal access time
        follows the token values), and no two jobs' ranges meet in a router they share."""
        self.space_base = k * RANGES_PER_BLOCK * TOKEN_SPACE
        for worker in self._workers.values():
            worker._space = 0

    def worker(self, block_size: int, eagle: bool, *, fresh: bool = False) -> IngestWorker:
        """The worker for (block size, eagle); ``fresh`` replaces it with a newly registered one.

        A replaced worker's relay and router stay referenced until :meth:`close` (dropping one
        in-process KvRouter can cancel the runtime's other routers).
        """
        key = (block_size, eagle)
        if fresh and key in self._workers:
            self.refreshed.add(key)
            old = self._workers.pop(key)
            old.publisher.close()
            self._retired.append(old)
        if key not in self._workers:
            if self.wedged:  # the runtime's loop never came back from a registration: every later one would wait too
                raise OracleUnavailable(self.wedged)
            pub = SglangPublisher(self.transform)
            plane = self.event_plane()
            try:
                relay, router = self.call(self._new_worker, block_size, eagle, pub.endpoint)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # pyo3 panics are BaseExceptions
                pub.close()
                what = (f"Dynamo {self.version} cannot start a worker relay + KvRouter for block size {block_size}"
                        f"{' (EAGLE)' if eagle else ''}")
                if self.wedged:  # the registration is what got stuck: say which worker it was
                    self.wedged = f"{what}: {self.wedged}"
                    raise OracleUnavailable(self.wedged) from None
                raise OracleUnavailable(f"{what}: {type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
            self._workers[key] = IngestWorker(self, block_size, eagle, pub, router, relay, plane)
            if _version_tuple(self.version) < RECOVERY_SYNC_BEFORE:
                self.await_recovery(self._workers[key])
        return self._workers[key]

    def await_recovery(self, worker: IngestWorker) -> bool:
        """Wait until ``worker``'s new router has applied what it recovers from the relay when it discovers it.

        Dynamo 1.0.2's ``KvRouter`` (local-indexer mode), on discovering a worker, asks the relay's local indexer
        for its whole tree ("WorkerQueryClient: discovered worker ..., recovering"); the first ask fails and is
        retried 200 ms later ("Got tree dump ... count: N", "Recovered N events", its log at
        ``DYN_LOG=dynamo_llm::kv_router=info``), so the tree it applies was taken while kvalign's first examples on
        the worker were already under way: blocks an example had removed since came back, and which examples
        (and which replays of them) it landed in followed the machine's load. 1.0.2's ``ingest`` and ``tenants``
        rows changed from one matrix run to the next that way (a finding in one, unconfirmed at 7 of 10 in the
        other; INGEST_STALE recurring in 0 of 10). A barrier sentinel does not cover it: the recovery is no event
        on the stream. So a sentinel is published while the event plane withholds everything the relay sends:
        the relay's local indexer holds it and the router can only learn it from that recovery. Once the router's
        index holds it, the recovery is applied and nothing later races it. False where it never arrived within
        :data:`INGEST_TIMEOUT_S` (its tree was taken before the relay indexed the sentinel)."""
        k = next(worker._sentinels)
        engine_hash = sentinel_hash(k)
        deadline, sent_at = time.monotonic() + INGEST_TIMEOUT_S, 0.0
        worker.plane.withheld = True
        try:
            while time.monotonic() < deadline:
                if time.monotonic() - sent_at > 0.05:  # re-send: the first may precede the relay's subscription
                    worker.publisher.publish([worker.publisher.sentinel(k, worker.block_size)])
                    sent_at = time.monotonic()
                time.sleep(POLL_MAX_S)
                if any(h == engine_hash for _p, h, _t in worker.dump()):
                    return True
            return False
        finally:
            worker.plane.withheld = False

    def attach(self, publisher: Any, block_size: int) -> IngestWorker:
        """A newly registered worker whose relay subscribes to ``publisher.endpoint`` (another engine's
        publisher; :meth:`IngestWorker.barrier` needs its ``publish`` and ``sentinel`` as
        :class:`SglangPublisher` has them, an engine with barriers of its own need not), with its router.
        The caller closes the publisher; the worker stays referenced until :meth:`close`."""
        plane = self.event_plane()
        relay, router = self.call(self._new_worker, block_size, False, publisher.endpoint)
        worker = IngestWorker(self, block_size, False, publisher, router, relay, plane)
        self._retired.append(worker)
        return worker

    @property
    def host_weight(self) -> float:
        """The ``host_cache_hit_weight`` this path's routers run with: they are built with the binding's
        default ``KvRouterConfig``, so its signature's default is their configuration. A release whose
        config has no such weight has no host tier: an error naming the field, never a guessed weight."""
        return configured_host_weight(self.core)

    def _tiered_router(self) -> bool:
        """Whether this release's router weighs host / disk tiers into its overlap (``host_cache_hit_weight``)."""
        return "host_cache_hit_weight" in (getattr(self.core.KvRouterConfig, "__text_signature__", None) or "")

    def _query(self, fn: Callable[..., Any], tokens: list[int], lora_name: str | None, cache_namespace: str | None) -> Any:
        kw: dict[str, Any] = {}
        if lora_name:
            kw["lora_name"] = lora_name
        if cache_namespace:
            kw["cache_namespace"] = cache_namespace
        try:
            return self.call(fn, tokens, **kw)
        except TypeError:
            if "cache_namespace" not in kw:
                raise
            self.missing.add("KvRouter query cache_namespace")
            kw.pop("cache_namespace")
            return self.call(fn, tokens, **kw)

    def query_tiers(self, router: Any, tokens: list[int], lora_name: str | None, cache_namespace: str | None) -> dict[str, int]:
        """The router's per-tier answer for a query: ``device_blocks``, ``host_pinned_extension_blocks``,
        ``disk_extension_blocks`` (0 each when no worker matched), from ``get_overlap_scores``.

        A release without ``get_overlap_scores``, or whose rows lack one of these keys, cannot say
        which tier a credited block is in: :class:`OracleUnavailable`, never a guessed 0."""
        if not hasattr(router, "get_overlap_scores"):
            raise OracleUnavailable(f"Dynamo {self.version}'s KvRouter has no get_overlap_scores: it does not report "
                                    "its overlap per tier")
        keys = ("device_blocks", "host_pinned_extension_blocks", "disk_extension_blocks")
        rows = self._query(router.get_overlap_scores, tokens, lora_name, cache_namespace)["workers"]
        if not rows:
            return dict.fromkeys(keys, 0)
        if len(rows) != 1:
            seen = "; ".join(", ".join(f"{k}={v}" for k, v in sorted(r.items()) if k in ("worker_id", "dp_rank", *keys))
                             for r in rows)
            raise OracleUnavailable(f"one worker per router expected, get_overlap_scores answered {len(rows)}: {seen}")
        absent = [k for k in keys if k not in rows[0]]
        if absent:
            raise OracleUnavailable(f"Dynamo {self.version}'s get_overlap_scores rows have no {', '.join(absent)} "
                                    f"(keys: {', '.join(sorted(rows[0]))})")
        return {k: int(rows[0][k]) for k in keys}

    def query_overlap(self, router: Any, tokens: list[int], lora_name: str | None, cache_namespace: str | None) -> int:
        """The router's device-tier overlap (blocks) for a query.

        ``device_blocks`` from ``get_overlap_scores`` where the release has it. Before that method,
        ``best_worker``'s overlap is the only answer; it is taken only from a router that has no
        tier weights, because a tiered router (``host_cache_hit_weight``) folds weighted host and
        disk credit into it, which would read as device blocks. The fallback is recorded in
        :attr:`missing`, so a report says which answer it compared.
        """
        if hasattr(router, "get_overlap_scores"):
            return self.query_tiers(router, tokens, lora_name, cache_namespace)["device_blocks"]
        if self._tiered_router():
            raise OracleUnavailable(f"Dynamo {self.version}'s router weighs host / disk tiers into best_worker's "
                                    "overlap and has no get_overlap_scores: no device-only overlap to compare")
        self.missing.add("KvRouter.get_overlap_scores (best_worker's overlap compared)")
        return int(self._query(router.best_worker, tokens, lora_name, cache_namespace)[2])

    def close(self) -> None:
        """Stop the publishers, then the runtime.

        Dynamo 1.6.1 may log "Brokered KV membership task ended unexpectedly" and
        "KeyValueStoreManager.watch receiver closed" here: a race between its own tasks and the
        runtime's cancellation, which no order of kvalign's calls avoids (unregistering and
        dropping the routers first was tried). :mod:`kvalign.runtime_log` keeps those lines in the
        log file.
        """
        try:
            # at once: SGLang's shutdown sleeps 0.1 s for its queue to drain, each (0.7 s for six workers)
            with concurrent.futures.ThreadPoolExecutor(max(1, len(self._workers))) as pool:
                list(pool.map(lambda w: w.publisher.close(), self._workers.values()))
            self._workers.clear()
            self._retired.clear()
            if not self.wedged:  # a wedged loop would not run the shutdown either
                self.call(lambda: self.runtime.shutdown())
        finally:
            self._stop_loop()
            self.broker.close()
            for plane in self._planes:
                plane.close()
            self._restore()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=1.0 if getattr(self, "wedged", None) else CALL_TIMEOUT_S)  # daemon thread: left behind

    def _restore(self) -> None:
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def __enter__(self) -> RouterPath:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
