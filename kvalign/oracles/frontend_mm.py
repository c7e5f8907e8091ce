"""Dynamo's real frontend preprocessing a chat request with images, as an oracle.

The router's multimodal keys are made in the frontend (Rust, ``lib/llm`` ``preprocessor``), not in
any Python-callable function: it renders the chat template, tokenises, asks its ``llm-multimodal``
registry how many placeholder tokens each image expands to, fills each image's run with a pad
value derived from the image's hash, and hands the router that *routing* sequence while the
worker gets the unexpanded prompt plus the hashes (``extra_args.mm_hashes``). So the oracle runs
the real thing:

    requests.post(/v1/chat/completions) -> python -m dynamo.frontend (--router-mode kv)
    -> recording worker (:mod:`kvalign.oracles.frontend_recorder`) -> the PreprocessedRequest

one frontend and one recording worker for the whole check, on loopback (file discovery in a
temporary directory, TCP request plane, ZMQ event plane through a 127.0.0.1 broker), one
registered model per page size (the routing sequence is padded to whole blocks of the card's
block size). Every request is bounded in time; :meth:`close` stops both processes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvalign.oracles.base import OracleUnavailable
from kvalign.oracles.frontend_recorder import model_name
from kvalign.oracles.router_path import LOOPBACK, LoopbackProxy
from kvalign.oracles.vlm_model import write_vlm_dir

#: Seconds the two processes may take to start (import Dynamo, register, discover) on a loaded machine.
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 30.0
NAMESPACE = "kvalign-mm"

#: One prompt part: ``("text", words)`` or ``("image", data URL)``.
Part = tuple[str, str]


@dataclass(frozen=True)
class Preprocessed:
    """What the frontend made of one chat request (from the PreprocessedRequest the worker got)."""

    page_size: int
    token_ids: list[int]  # what the worker executes: each image is one <|image_pad|>
    routing_token_ids: list[int] | None  # what the router hashes; None = no multimodal routing info
    block_mm_infos: list[Any] | None
    expanded_prompt_len: int | None
    mm_hashes: list[str] | None  # forwarded to the worker for SGLang's item hashes
    request: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def router_tokens(self) -> list[int]:
        """The sequence the frontend's KV router hashes: the routing tokens when it built them, else the prompt."""
        return list(self.routing_token_ids) if self.routing_token_ids is not None else list(self.token_ids)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def chat_content(parts: Sequence[Part]) -> list[dict[str, Any]]:
    """OpenAI chat content parts for ``parts``."""
    out: list[dict[str, Any]] = []
    for kind, value in parts:
        if kind == "text":
            out.append({"type": "text", "text": value})
        elif kind == "image":
            out.append({"type": "image_url", "image_url": {"url": value}})
        else:
            raise ValueError(f"unknown prompt part kind {kind!r}")
    return out


class FrontendPreprocessor:
    """``python -m dynamo.frontend`` plus the recording worker; :meth:`preprocess` one request at a time."""

    def __init__(self, page_sizes: Sequence[int], *, python: str = sys.executable) -> None:
        import requests

        self._requests = requests
        self.page_sizes = tuple(sorted(set(page_sizes)))
        self.dir = Path(tempfile.mkdtemp(prefix="kvalign-mm-frontend-"))
        self.model_dir = write_vlm_dir(self.dir / "kvalign-tiny-vl")
        self.record = self.dir / "requests.jsonl"
        self.record.touch()
        self.broker = LoopbackProxy()
        self.http_port = _free_port()
        self.url = f"http://{LOOPBACK}:{self.http_port}"
        env = {**os.environ, "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(self.dir / "discovery"),
               "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", "DYN_ZMQ_BROKER_URL": self.broker.url,
               "DYN_TCP_RPC_HOST": LOOPBACK, "DYN_TCP_RESPONSE_STREAM_HOST": LOOPBACK,
               "DYN_EVENT_PLANE_HOST": LOOPBACK, "DYN_SYSTEM_HOST": LOOPBACK, "DYN_NAMESPACE": NAMESPACE,
               "DYN_ROUTER_MIN_INITIAL_WORKERS": "0", "DYN_LOG": os.environ.get("DYN_LOG", "warn"),
               "PYTHONUNBUFFERED": "1"}
        self._procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        try:
            self._spawn("recorder", [python, "-m", "kvalign.oracles.frontend_recorder", "--model-path",
                                     str(self.model_dir), "--record", str(self.record), "--namespace", NAMESPACE,
                                     *(a for b in self.page_sizes for a in ("--page-size", str(b)))], env)
            self._spawn("frontend", [python, "-m", "dynamo.frontend", "--router-mode", "kv", "--http-host", LOOPBACK,
                                     "--http-port", str(self.http_port), "--namespace", NAMESPACE,
                                     "--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"],
                        env)
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = self.dir / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=str(self.dir))
        self._procs.append((name, proc, log))

    def _tail(self) -> str:
        return " | ".join(f"{name}: {log.read_text(errors='replace')[-400:]!r}" for name, _p, log in self._procs
                          if log.exists())

    def _wait_ready(self) -> None:
        want = {model_name(b) for b in self.page_sizes}
        deadline = time.monotonic() + START_TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:
            for name, proc, _log in self._procs:
                if proc.poll() is not None:
                    raise OracleUnavailable(f"Dynamo's {name} process exited ({proc.returncode}) while starting: "
                                            f"{self._tail()}")
            try:
                listed = {m["id"] for m in self._requests.get(f"{self.url}/v1/models", timeout=2).json().get("data", [])}
                if want <= listed:
                    return
                last = f"listed {sorted(listed)}"
            except (self._requests.RequestException, ValueError) as exc:
                last = f"{type(exc).__name__}"
            time.sleep(0.25)
        raise OracleUnavailable(f"Dynamo's frontend did not list the multimodal models within {START_TIMEOUT_S:.0f} s "
                                f"({last}); {self._tail()}")

    def preprocess(self, page_size: int, parts: Sequence[Part]) -> Preprocessed:
        """Send one chat request with ``parts`` for the page size's model; return what the worker got."""
        if page_size not in self.page_sizes:
            raise ValueError(f"page size {page_size} is not registered (have {self.page_sizes})")
        before = self.record.stat().st_size
        body = {"model": model_name(page_size), "max_tokens": 1, "temperature": 0.0, "stream": False,
                "messages": [{"role": "user", "content": chat_content(parts)}]}
        resp = self._requests.post(f"{self.url}/v1/chat/completions", json=body, timeout=(5.0, REQUEST_TIMEOUT_S))
        if resp.status_code != 200:
            raise OracleUnavailable(f"Dynamo's frontend answered HTTP {resp.status_code}: {resp.text[:300]}")
        with open(self.record, encoding="utf-8") as f:
            f.seek(before)
            lines = [json.loads(line) for line in f.read().splitlines() if line.strip()]
        if len(lines) != 1:
            raise OracleUnavailable(f"expected the recording worker to get 1 request, it got {len(lines)}")
        return parse_preprocessed(lines[0]["page_size"], lines[0]["request"])

    def close(self) -> None:
        for _name, proc, _log in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for _name, proc, _log in reversed(self._procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._procs.clear()
        self.broker.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> FrontendPreprocessor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_preprocessed(page_size: int, request: dict[str, Any]) -> Preprocessed:
    """The fields of a recorded PreprocessedRequest the multimodal property reads."""
    info = request.get("mm_routing_info") if isinstance(request.get("mm_routing_info"), dict) else None
    extra = request.get("extra_args") if isinstance(request.get("extra_args"), dict) else {}
    hashes = extra.get("mm_hashes")
    return Preprocessed(
        page_size=page_size,
        token_ids=[int(t) for t in request.get("token_ids") or []],
        routing_token_ids=None if info is None else [int(t) for t in info.get("routing_token_ids") or []],
        block_mm_infos=None if info is None else info.get("block_mm_infos"),
        expanded_prompt_len=None if info is None else info.get("expanded_prompt_len"),
        mm_hashes=list(hashes) if isinstance(hashes, list) else None,
        request=request,
    )
