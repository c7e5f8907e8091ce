"""A Dynamo worker that records what the real frontend sends it: the multimodal oracle's far end.

Dynamo's frontend turns a chat request with images into a ``PreprocessedRequest``: the prompt's
token ids, the multimodal routing info its KV router hashes (``mm_routing_info.routing_token_ids``,
each image's placeholder expanded and filled with the frontend's pad value) and the per-image
hashes it forwards to the worker (``extra_args.mm_hashes``). That request is only visible to the
worker, so this worker registers one model per page size (``ModelInput.Tokens``, a Qwen2-VL card
from :mod:`kvalign.oracles.vlm_model`), appends every request it gets as one JSON line to
``--record``, then answers one token. Nothing else is faked: the frontend, its preprocessor and
its router are the installed Dynamo's.

Run by :class:`kvalign.oracles.frontend_mm.FrontendPreprocessor`, never by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from typing import Any, AsyncIterator


def model_name(page_size: int) -> str:
    """The served model name for one page size (one card per page size: the frontend reads it)."""
    return f"kvalign-tiny-vl-b{page_size}"


async def serve(args: argparse.Namespace) -> None:
    from dynamo.llm import ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    loop = asyncio.get_running_loop()
    runtime = DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    record = open(args.record, "a", encoding="utf-8")

    def handler_for(page_size: int) -> Any:
        async def generate(request: dict[str, Any], context: Any = None) -> AsyncIterator[dict[str, Any]]:
            record.write(json.dumps({"page_size": page_size, "request": request}, default=str) + "\n")
            record.flush()
            yield {"index": 0, "token_ids": [0], "finish_reason": "length"}
        return generate

    tasks = []
    for b in args.page_size:
        endpoint = runtime.endpoint(f"{args.namespace}.recorder-b{b}.generate")
        tasks.append(asyncio.ensure_future(endpoint.serve_endpoint(handler_for(b), graceful_shutdown=False)))
        rc = ModelRuntimeConfig()
        rc.enable_local_indexer = True
        rc.kv_event_publishing_enabled = True
        await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint, args.model_path,
                             model_name(b), kv_cache_block_size=b, runtime_config=rc,
                             worker_type=WorkerType.Aggregated, needs=[])
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("recorder ready", flush=True)
    waiting = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({waiting, *tasks}, return_when=asyncio.FIRST_COMPLETED)
    for task in tasks:
        if task in done:
            task.result()  # a serving failure: exit non-zero with its traceback
        task.cancel()
    record.close()
    runtime.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvalign.oracles.frontend_recorder", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--record", required=True, help="JSON-lines file every received request is appended to")
    p.add_argument("--namespace", required=True)
    p.add_argument("--page-size", type=int, action="append", required=True)
    asyncio.run(serve(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's slow teardown of Dynamo's runtime threads (see fake_cpu_worker)
