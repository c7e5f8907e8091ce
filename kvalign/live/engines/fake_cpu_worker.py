"""A real Dynamo worker on CPU whose prefix cache is SGLang's real radix cache.

Why it exists: the router half of the GPU nightly ("requests sharing a prefix go to one worker
and the router reports kv_hit_rate > 0") depends only on (a) what keys the engine's cache
publishes and (b) how the worker registers with the router. Neither needs a model. This worker
keeps both real and drops the rest:

* runtime: ``dynamo.runtime.DistributedRuntime`` (file discovery, tcp request plane, zmq event
  plane), endpoint ``{namespace}.{component}.generate`` served with ``serve_endpoint``;
* registration: ``register_model(ModelInput.Tokens, ...)`` with a ``ModelRuntimeConfig`` whose
  ``enable_eagle`` from ``dynamo.sglang.register``'s own derivation (imported, not copied:
  ``SpeculativeAlgorithm.from_string(alg).is_eagle()``), ``kv_event_publishing_enabled`` and
  ``enable_local_indexer`` as ``dynamo.sglang`` sets them, and the same worker types / ``needs``
  per disaggregation mode as ``dynamo.sglang.init_llm``;
* cache: SGLang's server-default ``UnifiedRadixCache`` (bigram keys when the speculative
  algorithm is an EAGLE variant), via :class:`kvalign.oracles.sglang.SglangRadixCache`;
* events: SGLang's own ``EventPublisherFactory``/``ZmqEventPublisher`` built from a
  ``--kv-events-config`` JSON (same flag and format as SGLang), each batch a ``KVEventBatch``
  exactly as SGLang's scheduler publishes it; relayed by Dynamo's ``KvEventPublisher`` in ZMQ
  relay mode, connected the way ``dynamo.sglang.publisher`` connects it;
* flush: ``{namespace}.{component}.clear_kv_blocks`` served as ``dynamo.sglang`` serves it
  (``init_llm``; refused while a request is active), calling SGLang's own cache ``reset`` as the
  scheduler's ``flush_cache`` does, so SGLang's ``AllBlocksCleared`` reaches the router. The e2e
  tests' shared clusters flush through it between tests (:func:`kvalign.live.cluster.control.clear_kv_blocks`).

What is fake: generation. Each request streams ``max_tokens`` tokens echoing the prompt
cyclically (deterministic, in-vocabulary), and on finish the committed tokens (prompt + all
output tokens but the last, whose KV a real engine has not computed yet) go into the cache.

``--register-eagle on|off`` overrides only the router-facing flag, to build the negative
control (a bigram-keyed cache registered as non-EAGLE) that Dynamo #10982/#11764 shipped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator
from urllib.parse import urlparse

log = logging.getLogger("kvalign.cpu_worker")

MODES = ("null", "prefill", "decode")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvalign.live.engines.fake_cpu_worker", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True, help="local model dir (tokenizer, config, chat template)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--namespace", default=os.environ.get("DYN_NAMESPACE", "dynamo"))
    p.add_argument("--component", default=None, help="default: prefill for prefill workers, else backend")
    p.add_argument("--endpoint", default="generate")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--speculative-algorithm", default=None, help="e.g. EAGLE3: bigram-keyed cache, as SGLang")
    p.add_argument("--register-eagle", choices=("auto", "on", "off"), default="auto",
                   help="router-facing enable_eagle: auto derives it like dynamo.sglang (negative control: off)")
    p.add_argument("--kv-events-config", default=None, help='SGLang JSON, e.g. {"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557","bind":true}')
    p.add_argument("--disaggregation-mode", choices=MODES, default="null")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--no-bootstrap-endpoint", action="store_true",
                   help="prefill: do not advertise the bootstrap endpoint in the card (frontend then waits "
                        "for the prefill response's disaggregated_params instead of pre-computing them)")
    p.add_argument("--token-delay-ms", type=float, default=2.0, help="pause between streamed tokens")
    p.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "file"))
    p.add_argument("--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "tcp"))
    p.add_argument("--event-plane", default=os.environ.get("DYN_EVENT_PLANE", "zmq"))
    args = p.parse_args(argv)
    if args.page_size < 1:
        p.error(f"--page-size must be >= 1, got {args.page_size}")
    if args.component is None:
        args.component = "prefill" if args.disaggregation_mode == "prefill" else "backend"
    if args.served_model_name is None:
        args.served_model_name = Path(args.model_path).name
    return args


def _sglang_shim() -> None:
    """SGLang imports only behind kvalign's torchvision shim (see :mod:`kvalign.oracles.sglang`)."""
    from kvalign.oracles.sglang import _modules

    _modules()


def eagle_enabled_for(speculative_algorithm: str | None) -> bool:
    """``enable_eagle`` exactly as ``dynamo.sglang`` registers it: its own function, imported.

    ``dynamo.sglang.register._eagle_enabled_for`` calls SGLang's ``is_eagle()``, the predicate
    the radix cache uses to bigram-key pages (Dynamo #10982 replaced a hand-kept name set). On
    another Dynamo release (``e2e run --dynamo``) that release's ``dynamo.sglang`` imports only
    beside its own SGLang, so the workers register what the fixed function computes: SGLang's
    ``is_eagle()`` itself. What such a run tests is that release's frontend and router.
    """
    _sglang_shim()
    try:
        from dynamo.sglang.register import _eagle_enabled_for
    except ImportError:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return SpeculativeAlgorithm.from_string(speculative_algorithm).is_eagle()
    return _eagle_enabled_for(speculative_algorithm)


def relay_endpoint(kv_events_config: str) -> str:
    """The endpoint Dynamo's relay connects to, as ``dynamo.sglang.publisher`` computes it.

    ``ZmqEventPublisher.offset_endpoint_port(base, dp_rank=0)``, then a wildcard host becomes
    127.0.0.1 and a concrete host becomes ``get_local_ip_auto()`` (which honours
    ``SGLANG_HOST_IP``, so the harness sets it to 127.0.0.1).
    """
    _sglang_shim()
    from sglang.srt.disaggregation.kv_events import ZmqEventPublisher
    from sglang.srt.utils.network import NetworkAddress, get_local_ip_auto

    base = json.loads(kv_events_config)["endpoint"]
    ep = ZmqEventPublisher.offset_endpoint_port(base, 0)
    host = urlparse(ep).hostname
    ip = "127.0.0.1" if host in ("*", "0.0.0.0", "::") else get_local_ip_auto()
    return NetworkAddress(ip, urlparse(ep).port).to_tcp()


class Engine:
    """The fake engine: SGLang's radix cache + SGLang's ZMQ event publisher, no model."""

    def __init__(self, args: argparse.Namespace):
        from kvalign.oracles.sglang import SglangRadixCache

        _sglang_shim()
        from sglang.srt.disaggregation.kv_events import EventPublisherFactory, KVEventBatch

        self.cache_eagle = eagle_enabled_for(args.speculative_algorithm)
        self.cache = SglangRadixCache(args.page_size, eagle=self.cache_eagle, kind="unified")
        self._batch = KVEventBatch
        self.publisher = EventPublisherFactory.create(args.kv_events_config, 0) if args.kv_events_config else None
        self.delay = args.token_delay_ms / 1000.0

    def cache_and_publish(self, tokens: list[int]) -> int:
        """Insert a finished request's committed tokens; publish the resulting events."""
        hit = self.cache.insert(tokens)
        self._publish_pending()
        return hit

    def flush(self) -> None:
        """Drop the whole cache and publish SGLang's ``AllBlocksCleared``, as ``flush_cache`` does."""
        self.cache.reset()
        self._publish_pending()

    def _publish_pending(self) -> None:
        events = self.cache.take_raw_events()
        if events and self.publisher is not None:
            self.publisher.publish(self._batch(ts=time.time(), events=events))

    async def stream(self, prompt: list[int], max_tokens: int) -> AsyncIterator[int]:
        for i in range(max_tokens):
            await asyncio.sleep(self.delay)
            yield prompt[i % len(prompt)]

    def shutdown(self) -> None:
        if self.publisher is not None:
            from kvalign.oracles.sglang import shutdown_publisher

            shutdown_publisher(self.publisher)


def _max_tokens(request: dict[str, Any]) -> int:
    stop = request.get("stop_conditions") or {}
    n = stop.get("max_tokens")
    return max(1, int(n)) if n else 16


class Handler:
    """``generate`` for the three serving modes, with dynamo.sglang's response shapes."""

    def __init__(self, engine: Engine, mode: str, bootstrap_port: int):
        self.engine, self.mode, self.bootstrap_port = engine, mode, bootstrap_port
        self.active = 0  # requests in flight: a flush is refused meanwhile, as dynamo.sglang refuses it

    async def clear_kv_blocks(self, request: dict[str, Any] | None = None, context: Any = None) -> AsyncIterator[dict[str, Any]]:
        """``clear_kv_blocks`` with ``dynamo.sglang``'s answers (``handler_base.clear_kv_blocks``)."""
        if self.active:
            yield {"status": "error", "message": "Cannot clear KV cache while requests are active"}
            return
        self.engine.flush()
        yield {"status": "success", "message": "KV cache cleared"}

    async def generate(self, request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
        self.active += 1
        try:
            async for chunk in self._generate(request):
                yield chunk
        finally:
            self.active -= 1

    async def _generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        inner = request.get("request", request)  # DisaggPreprocessedRequest wraps the request
        prompt = list(inner.get("token_ids") or [])
        if not prompt:
            raise ValueError("request has no token_ids")
        if self.mode == "prefill":
            log.info("prefill: request bootstrap_info=%s", inner.get("bootstrap_info"))
            # PrefillWorkerHandler: the first (and only) output carries the bootstrap info the
            # decode side needs; the prompt's KV is what the prefill worker caches.
            info = inner.get("bootstrap_info") if isinstance(inner.get("bootstrap_info"), dict) else {}
            yield {"token_ids": [], "text": None, "finish_reason": None, "disaggregated_params": {
                "bootstrap_host": info.get("bootstrap_host", "127.0.0.1"),
                "bootstrap_port": info.get("bootstrap_port", self.bootstrap_port),
                "bootstrap_room": info.get("bootstrap_room", random.randint(0, 2**63 - 1)),
            }}
            self.engine.cache_and_publish(prompt)
            return
        if self.mode == "decode":
            if not request.get("bootstrap_info"):
                raise RuntimeError("bootstrap_info is required for disaggregated decode but was not provided")
            log.info("decode: bootstrap_info=%s prefill_result=%s", request.get("bootstrap_info"),
                     json.dumps(request.get("prefill_result"))[:300])
        n = _max_tokens(request)
        out: list[int] = []
        async for tok in self.engine.stream(prompt, n):
            out.append(tok)
            chunk: dict[str, Any] = {"index": 0, "token_ids": [tok]}
            if len(out) == n:
                chunk["finish_reason"] = "length"
            yield chunk
        if self.mode == "null":
            self.engine.cache_and_publish(prompt + out[:-1])


async def _register(args: argparse.Namespace, endpoint: Any, engine: Engine) -> dict[str, Any]:
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model

    rc = ModelRuntimeConfig()
    rc.enable_local_indexer = args.disaggregation_mode != "decode"
    if hasattr(rc, "kv_event_publishing_enabled"):  # not in the bindings of older releases (1.3.1)
        rc.kv_event_publishing_enabled = bool(args.kv_events_config)
    rc.data_parallel_start_rank, rc.data_parallel_size = 0, 1
    register_eagle = {"auto": engine.cache_eagle, "on": True, "off": False}[args.register_eagle]
    if register_eagle:
        rc.enable_eagle = True
    if args.disaggregation_mode == "prefill":
        if not args.no_bootstrap_endpoint:
            rc.set_disaggregated_endpoint("127.0.0.1", args.disaggregation_bootstrap_port)
        output_type, worker_type, needs = ModelType.Prefill, WorkerType.Prefill, [[WorkerType.Decode]]
    elif args.disaggregation_mode == "decode":
        output_type, worker_type, needs = ModelType.Chat | ModelType.Completions, WorkerType.Decode, [[WorkerType.Prefill]]
    else:
        output_type, worker_type, needs = ModelType.Chat | ModelType.Completions, WorkerType.Aggregated, []
    await register_model(
        ModelInput.Tokens, output_type, endpoint, args.model_path, args.served_model_name,
        kv_cache_block_size=args.page_size, runtime_config=rc, worker_type=worker_type, needs=needs,
    )
    return {"register_eagle": register_eagle}


async def serve(args: argparse.Namespace) -> None:
    from dynamo.llm import KvEventPublisher
    from dynamo.runtime import DistributedRuntime

    engine = Engine(args)
    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, args.discovery_backend, args.request_plane, event_plane=args.event_plane)
    endpoint = runtime.endpoint(f"{args.namespace}.{args.component}.{args.endpoint}")
    clear_endpoint = runtime.endpoint(f"{args.namespace}.{args.component}.clear_kv_blocks")
    relay = None
    if args.kv_events_config:
        relay = KvEventPublisher(
            endpoint=endpoint, kv_block_size=args.page_size, zmq_endpoint=relay_endpoint(args.kv_events_config),
            zmq_topic="", enable_local_indexer=args.disaggregation_mode != "decode", dp_rank=0,
        )
    handler = Handler(engine, args.disaggregation_mode, args.disaggregation_bootstrap_port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def register_then_report() -> None:
        flags = await _register(args, endpoint, engine)
        status = {
            "instance_id": endpoint.connection_id(), "role": args.disaggregation_mode,
            "component": args.component, "cache_eagle": engine.cache_eagle, "cache_core": engine.cache.core,
            "kv_events_endpoint": relay_endpoint(args.kv_events_config) if args.kv_events_config else None,
            "page_size": args.page_size, "pid": os.getpid(), **flags,
        }
        log.info("registered: %s", json.dumps(status))
        await stop.wait()

    serving = asyncio.ensure_future(endpoint.serve_endpoint(handler.generate, graceful_shutdown=False))
    clearing = asyncio.ensure_future(clear_endpoint.serve_endpoint(handler.clear_kv_blocks, graceful_shutdown=False))
    reporting = asyncio.ensure_future(register_then_report())
    tasks = (serving, clearing, reporting)
    try:
        done, _ = await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # surface a registration or serving failure as a non-zero exit
    finally:
        for task in tasks:
            task.cancel()
        if relay is not None:
            relay.shutdown()
        engine.shutdown()
        runtime.shutdown()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = parse_args(argv)
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is shut down in order by now (relay, SGLang's publisher, the runtime). What is left
    # is the interpreter's teardown of Dynamo's runtime, which was measured taking ~6 s on its own
    # threads after the runtime's exit hook (0.4 s after SIGTERM): close to the harness's 8 s
    # SIGTERM grace on a loaded machine. Only stdio still has anything to flush.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
