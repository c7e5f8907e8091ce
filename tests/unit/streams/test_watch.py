"""``kvalign watch`` as a real process: live lines per batch, a publisher restart, Ctrl-C -> exit 0."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq
from sglang_publisher import RealPublisher

from kvalign.oracles.sglang import SglangRadixCache
from kvalign.streams.watch import Watcher

B = 4


class LineReader:
    """Collects a child's stdout lines on a thread so the test can wait for one with a deadline."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            self._q.put(line.rstrip("\n"))

    def wait_for(self, needle: str, timeout_s: float = 10.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self._q.get(timeout=0.05)
            except queue.Empty:
                continue
            self.lines.append(line)
            if needle in line:
                return line
        raise AssertionError(f"no line containing {needle!r} within {timeout_s}s; got {self.lines}")


def _rebind(port: int, timeout_s: float = 10.0) -> RealPublisher:
    """A new publisher on ``port``, once ZMQ's I/O thread has released the old socket."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return RealPublisher(port=port)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.timeout(120)
def test_watch_survives_a_publisher_restart_and_exits_0_on_ctrl_c():
    first: RealPublisher | None = RealPublisher()
    port = first.port
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvalign", "watch", "--endpoint", first.endpoint, "--router-eagle", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    out = LineReader(proc.stdout)
    second = None
    try:
        out.wait_for("watching")
        deadline = time.monotonic() + 15
        while not any(line.startswith("seq ") for line in out.lines):  # slow joiner: warm up
            assert time.monotonic() < deadline, out.lines
            first.publish([first.warm_up_event()])
            try:
                out.wait_for("seq ", 0.2)
            except AssertionError:
                pass
        cache = SglangRadixCache(B, eagle=True)
        cache.insert(list(range(1, 22)))
        seq = first.publish(cache.take_raw_events())
        line = out.wait_for(f"seq {seq}:")
        assert "+5 stored" in line and "bigram pages" in line and "5 blocks can never match" in line
        first.close()
        first = None

        second = _rebind(port)  # the engine restarts on the same endpoint
        fresh = SglangRadixCache(B, eagle=True)
        fresh.insert(list(range(50, 59)))
        events = [second.warm_up_event(), *fresh.take_raw_events()]
        deadline = time.monotonic() + 15
        while True:  # the SUB reconnects on its own; publish until it is back
            second.publish(events)
            try:
                restart = out.wait_for("RESTART", 0.3)
                break
            except AssertionError:
                assert time.monotonic() < deadline, out.lines
        assert "went back" in restart
        out.wait_for("+2 stored")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:  # never leave a watch behind, whatever failed
                proc.kill()
        for pub in (first, second):
            if pub is not None:
                pub.close()
    summary = out.wait_for("watch summary")
    assert rc == 0, proc.stderr.read()
    assert "1 restarts" in summary and "invisible to a router with eagle off" in summary
    assert "Traceback" not in proc.stderr.read()


def test_watcher_reports_gaps_and_malformed_frames():
    w = Watcher(block_size=B)
    ok = [b"", (0).to_bytes(8, "big"), bytes.fromhex("93cb41d954fc400000009000")]  # [ts, [], 0]
    assert w.on_frames(ok) == ["seq 0: +0 stored -0 removed | router index: 0 blocks held"]
    lines = w.on_frames([b"", (3).to_bytes(8, "big"), ok[2]])
    assert lines[0].startswith("seq 3: GAP: 2 batches missing (seq 1..2)")
    bad = w.on_frames([b"", (4).to_bytes(8, "big"), ok[2][:5]])
    assert "malformed batch skipped" in bad[0] and "not valid msgpack" in bad[0]
    assert "1 gaps (2 batches missing)" in w.summary() and "1 malformed" in w.summary()
