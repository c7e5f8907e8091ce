"""Shared fixtures of the live layer's unit tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@pytest.fixture
def metrics_page() -> Iterator[tuple[str, dict[str, Any]]]:
    """A /metrics page on loopback: ``served["pages"][path]`` (else ``served["text"]``) is what a GET
    of ``path`` answers, and ``served["gets"]`` counts the scrapes (what the fuzz's costs are made of)."""
    served: dict[str, Any] = {"text": "", "pages": {}, "gets": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            served["gets"] += 1
            body = served["pages"].get(self.path, served["text"]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", served
    finally:
        server.shutdown()
        server.server_close()
