"""Dynamo's real KV router, in process, as the oracle for the sequence-hash chain.

ai-dynamo-runtime 1.6.1 has no binding that returns sequence hashes, but the router computes them
for every request: in approximate mode (``use_kv_events=False``) ``best_worker(...,
update_indexer=True)`` stores the routing decision in the router's own indexer with
``block_hash = sequence hash`` and ``tokens_hash = local hash``, and ``dump_events()`` shows those
pairs as a tree (stored events linked by ``parent_hash``). This module brings that router up with
no external service (``mem`` discovery, ``tcp`` request plane, ``zmq`` event plane, every listener
on 127.0.0.1) and reads one request's chain back out of the dump.

A router hashes queries in EAGLE mode when its model card says ``enable_eagle``, so there is one
endpoint + card + router per (block size, eagle) pair, created on first use. All routers live in
one runtime and are dropped together: Dynamo documents that dropping one in-process ``KvRouter``
cancels the others.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

LOOPBACK = "127.0.0.1"

#: Set while the runtime lives: every Dynamo listener binds and advertises loopback (without these
#: the request plane listens on the machine's LAN address), routers start without waiting for
#: workers, and the Rust log stays quiet.
RUNTIME_ENV = {
    "DYN_TCP_RPC_HOST": LOOPBACK,
    "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,
    "DYN_EVENT_PLANE_HOST": LOOPBACK,
    "DYN_SYSTEM_HOST": LOOPBACK,
    "DYN_ROUTER_MIN_INITIAL_WORKERS": "0",
    "DYN_LOG": "error",
}

#: Seconds one router call may take before the oracle gives up (calls take well under 10 ms).
CALL_TIMEOUT_S = 30.0

#: Seconds a new router may take to see its endpoint's instance (milliseconds when idle).
ROUTABLE_TIMEOUT_S = 20.0

Pair = tuple[int, int]  # (block_hash = router sequence hash, tokens_hash = local hash)


class ChainExtractionError(AssertionError):
    """The router's dump does not hold one unambiguous chain for a request."""


@dataclass(frozen=True)
class RouterChain:
    """What the router stored for one request.

    ``pairs``: the request's path from the root of the router's tree, in block order.
    ``overlap``: how many leading blocks were already stored before the request (``best_worker``'s
    own answer). ``stored``: the pairs the request added to the dump (after minus before).
    """

    pairs: list[Pair]
    overlap: int
    stored: frozenset[Pair]


def dump_edges(dump: Sequence[Mapping[str, Any]]) -> dict[tuple[int | None, int], list[int]]:
    """``(parent block_hash, child tokens_hash) -> [child block_hash, ...]`` over a router dump.

    Within one stored event each block is the child of the previous one; the first block is the
    child of ``parent_hash`` (``None`` = the root).
    """
    edges: dict[tuple[int | None, int], list[int]] = {}
    for entry in dump:
        stored = entry["event"]["data"]["stored"]
        parent = stored["parent_hash"]
        for block in stored["blocks"]:
            children = edges.setdefault((parent, block["tokens_hash"]), [])
            if block["block_hash"] not in children:
                children.append(block["block_hash"])
            parent = block["block_hash"]
    return edges


def walk_chain(dump: Sequence[Mapping[str, Any]], local: Sequence[int]) -> list[Pair]:
    """The router's path for ``local``: from the root, follow the child keyed by the next local hash.

    This is the walk the router's own radix tree does when it matches a prompt. It stops where no
    child has the next local hash (so a router that hashed a block differently yields a shorter
    path, which the caller sees as a mismatch) and raises if a step is ambiguous.
    """
    edges = dump_edges(dump)
    path: list[Pair] = []
    parent: int | None = None
    for h in local:
        children = edges.get((parent, int(h)), [])
        if len(children) > 1:
            raise ChainExtractionError(f"router tree has {len(children)} children with tokens_hash {h} under {parent}: {children}")
        if not children:
            break
        parent = children[0]
        path.append((parent, int(h)))
    return path


def dump_pairs(dump: Sequence[Mapping[str, Any]]) -> set[Pair]:
    return {(b["block_hash"], b["tokens_hash"]) for e in dump for b in e["event"]["data"]["stored"]["blocks"]}


class DynamoRouterOracle:
    """Real in-process Dynamo runtime + approximate-mode ``KvRouter`` per (block size, eagle).

    The runtime needs a running asyncio loop for its whole life, so it gets its own thread; the
    synchronous methods submit coroutines to it. Use as a context manager (it is torn down on exit).
    """

    def __init__(self) -> None:
        self._saved_env = {k: os.environ.get(k) for k in RUNTIME_ENV}
        os.environ.update(RUNTIME_ENV)  # before the import: the binding sets up its log on import
        try:
            from dynamo import _core  # ImportError where ai-dynamo-runtime is missing
        except ImportError:
            self._restore_env()
            raise
        self._core = _core
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dynamo-router-oracle", daemon=True)
        self._thread.start()
        self._routers: dict[tuple[int, bool], Any] = {}
        try:
            self._runtime = self._call(self._start_runtime)
        except BaseException:
            self._stop_loop()
            self._restore_env()
            raise

    async def _start_runtime(self) -> Any:
        return self._core.DistributedRuntime(asyncio.get_running_loop(), "mem", "tcp", event_plane="zmq")

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the runtime's loop (the binding's async methods must be
        *called* there, not only awaited) and wait for its result."""

        async def invoke() -> Any:
            result = fn(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        return asyncio.run_coroutine_threadsafe(invoke(), self._loop).result(timeout=CALL_TIMEOUT_S)

    async def _new_router(self, block_size: int, eagle: bool) -> Any:
        c = self._core
        name = f"seq-b{block_size}-{'eagle' if eagle else 'plain'}"
        endpoint = self._runtime.endpoint(f"kvalign.{name}.generate")
        card = c.ModelRuntimeConfig()
        card.enable_eagle = eagle  # decides query-side (router) eagle hashing
        await c.register_model(c.ModelInput.Tensor, c.ModelType.TensorBased, endpoint, name,
                               worker_type=c.WorkerType.Aggregated, kv_cache_block_size=block_size, runtime_config=card)
        await endpoint.register_endpoint_instance()
        # A long TTL so nothing the router stored expires while a test reads it back.
        router = c.KvRouter(endpoint, block_size, c.KvRouterConfig(use_kv_events=False, router_ttl_secs=3600.0))
        await self._until_routable(router, block_size)
        return router

    @staticmethod
    async def _until_routable(router: Any, block_size: int) -> None:
        """Wait until the router's discovery watch has seen the endpoint's instance.

        ``register_endpoint_instance`` returns before the router's watch delivers the instance; a
        query in between fails with "no endpoints available to route work" (seen on a loaded CI
        machine as a Hypothesis FlakyFailure). The probe does not update the indexer, so it leaves
        nothing in the dump a test reads back.
        """
        deadline = asyncio.get_running_loop().time() + ROUTABLE_TIMEOUT_S
        while True:
            try:
                await router.best_worker([0] * block_size, update_indexer=False)
                return
            except Exception as exc:
                if "no endpoints" not in str(exc) or asyncio.get_running_loop().time() > deadline:
                    raise
            await asyncio.sleep(0.02)

    def router(self, block_size: int, eagle: bool) -> Any:
        key = (block_size, eagle)
        if key not in self._routers:
            self._routers[key] = self._call(self._new_router, block_size, eagle)
        return self._routers[key]

    def dump(self, block_size: int, eagle: bool) -> list[dict[str, Any]]:
        return json.loads(self._call(self.router(block_size, eagle).dump_events))

    def chain(
        self,
        tokens: Sequence[int],
        block_size: int,
        local: Sequence[int],
        *,
        eagle: bool,
        lora_name: str | None = None,
        cache_namespace: str | None = None,
        mm_infos: Sequence[Mapping[str, Any] | None] | None = None,
    ) -> RouterChain:
        """Route one request through the real router and read back what it stored for it.

        ``local`` are the request's local block hashes; the path is found by walking them down the
        router's tree exactly as the router matches (see :func:`walk_chain`).
        """
        router = self.router(block_size, eagle)
        before = dump_pairs(self.dump(block_size, eagle))
        _, _, overlap = self._call(
            router.best_worker, list(tokens), update_indexer=True,
            block_mm_infos=None if mm_infos is None else list(mm_infos), lora_name=lora_name, cache_namespace=cache_namespace)
        after = self.dump(block_size, eagle)
        return RouterChain(walk_chain(after, local), int(overlap), frozenset(dump_pairs(after) - before))

    def close(self) -> None:
        try:
            self._call(self._shutdown)
        finally:
            self._stop_loop()
            self._restore_env()

    def _restore_env(self) -> None:
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    async def _shutdown(self) -> None:
        self._routers.clear()
        self._runtime.shutdown()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=CALL_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> DynamoRouterOracle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
