"""The worker-to-router path with Dynamo's relay in a process of its own, as a deployment runs it.

:class:`~kvalign.oracles.router_path.RouterPath` runs a release's worker relay (``KvEventPublisher``)
and its ``KvRouter`` in kvalign's own process, on one runtime with in-memory discovery. Some older
releases' relays stop indexing there (1.3.1's does during a ``check`` run, and a re-registered one
stops too) while the same relay in a worker's own process, as the live layer runs it
(:mod:`kvalign.live.engines.fake_cpu_worker`: one runtime per worker process, file discovery, the
ZMQ event plane through a broker), keeps indexing. A finding that only the in-process path shows is
the harness, not the release; :class:`ProcessRouterPath` is the same path with each relay moved out:

    SGLang publisher (this process) -> relay + its runtime (``python -m kvalign.oracles.relay_process``,
    a child on this interpreter, so the same release) -> event plane broker -> KvRouter (this process)

The router discovers the child's registration through a ``DYN_FILE_KV`` directory of its own. The
child is the same code the in-process path runs (:func:`~kvalign.oracles.router_path.register_relay`);
only the process boundary differs, which is what a re-check with it isolates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.router_path import RouterPath, Transform, register_relay, runtime_env, worker_path

#: Seconds a relay process may take to import Dynamo, register and subscribe (about 2 s on an idle core).
READY_TIMEOUT_S = 60.0
READY = "kvalign-relay-ready"


class RelayProcess:
    """One relay child: started registered and subscribed; :meth:`close` ends it (closing its stdin)."""

    def __init__(self, env: dict[str, str], name: str, block_size: int, eagle: bool, zmq_endpoint: str) -> None:
        cmd = [sys.executable, "-m", "kvalign.oracles.relay_process", "--name", name,
               "--block-size", str(block_size), "--zmq-endpoint", zmq_endpoint, *(["--eagle"] if eagle else [])]
        #: the child's log (its runtime's lines): a file, so that a chatty release never blocks on a full pipe
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        #: card fields the child's release lacks (reported like the in-process path's ``missing``)
        self.missing: list[str] = self._wait_ready()

    def _wait_ready(self) -> list[str]:
        deadline = time.monotonic() + READY_TIMEOUT_S
        assert self.proc.stdout is not None
        # a selector, not select(): a check that has started many relays holds descriptors past select()'s
        # 1024 ("filedescriptor out of range in select()": Dynamo 1.3.1 x vLLM 0.23.0's fifteen rows)
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(0.5):
                    line = self.proc.stdout.readline()
                    if line.startswith(READY):
                        return list(json.loads(line[len(READY):]))
                    if not line:  # the child exited before it was ready
                        break
        self.close()
        self.log.seek(0)
        err = [ln for ln in self.log.read().splitlines() if ln.strip()]
        raise OracleUnavailable("the relay's own process did not start"
                                + (f": {err[-1]}" if err else f" within {READY_TIMEOUT_S:.0f} s"))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class ProcessRouterPath(RouterPath):
    """:class:`RouterPath` with every worker's relay in a child process (file discovery, ZMQ event plane)."""

    def __init__(self, transform: Transform | None = None) -> None:
        self._kv_dir = Path(tempfile.mkdtemp(prefix="kvalign-relay-kv-"))
        self._children: list[RelayProcess] = []
        super().__init__(transform)

    def _extra_env(self) -> dict[str, str]:
        return {"DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(self._kv_dir)}

    async def _start(self) -> Any:
        loop = asyncio.get_running_loop()
        try:
            return self.core.DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
        except TypeError:  # before the event_plane keyword: DYN_EVENT_PLANE decides
            return self.core.DistributedRuntime(loop, "file", "tcp", False)

    async def _new_worker(self, block_size: int, eagle: bool, zmq_endpoint: str) -> tuple[Any, Any]:
        name = f"relay-b{block_size}-{'eagle' if eagle else 'plain'}-{len(self._children)}"
        # the worker's own event plane (:meth:`RouterPath.event_plane`, set just before), which its router reads too
        env = {**os.environ, **runtime_env(self.version, os.environ["DYN_ZMQ_BROKER_URL"]), **self._extra_env()}
        child = await asyncio.to_thread(RelayProcess, env, name, block_size, eagle, zmq_endpoint)
        self._children.append(child)
        self.missing.update(child.missing)
        router = self.core.KvRouter(self.runtime.endpoint(worker_path(name)), block_size, self.core.KvRouterConfig(use_kv_events=True))
        return child, router

    def close(self) -> None:
        try:
            super().close()
        finally:
            for child in self._children:
                child.close()
            shutil.rmtree(self._kv_dir, ignore_errors=True)


async def _serve(args: argparse.Namespace) -> None:
    from dynamo import _core as core

    loop = asyncio.get_running_loop()
    try:
        runtime = core.DistributedRuntime(loop, "file", "tcp", event_plane="zmq")
    except TypeError:
        runtime = core.DistributedRuntime(loop, "file", "tcp", False)
    missing: set[str] = set()
    endpoint, relay = await register_relay(core, runtime, args.name, args.block_size, args.eagle, args.zmq_endpoint,
                                           missing)  # held until the end: a dropped relay stops relaying
    print(READY + json.dumps(sorted(missing)), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes our stdin (or dies)
    del relay, endpoint
    runtime.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvalign.oracles.relay_process")
    ap.add_argument("--name", required=True, help="the worker's model name (its endpoint: kvalign-NAME.worker.generate)")
    ap.add_argument("--block-size", type=int, required=True)
    ap.add_argument("--eagle", action="store_true", help="the card's enable_eagle")
    ap.add_argument("--zmq-endpoint", required=True, help="SGLang's KV-event publisher the relay subscribes to")
    args = ap.parse_args(argv)
    try:
        asyncio.run(_serve(args))
    except OracleUnavailable as exc:
        print(f"kvalign: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
