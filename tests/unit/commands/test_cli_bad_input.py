"""Bad input anywhere in capture/replay/diagnose/watch: one line on stderr, exit 2, nothing corrupted.

Each row builds the bad input for real (a dead port, a live publisher on another topic, a capture
cut inside its header, a frame truncated on the wire...) and runs the real CLI entry point.
Every capture file present before the command is byte-identical afterwards.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from sglang_publisher import RECORDED, RealPublisher, free_port, raw_capture, sglang_publisher  # noqa: F401

from kvalign.streams.capture import FORMAT_VERSION, CaptureWriter
from kvalign.cli import main
from kvalign.model.events import EventBatch, decode_payload

pytestmark = pytest.mark.usefixtures("cli_parser")  # main() runs 24 times in this module

GOOD = bytes.fromhex(RECORDED[("0.5.23", True)])


def good_capture(tmp: Path) -> str:
    path = tmp / "good.jsonl"
    w = CaptureWriter(str(path), endpoint="tcp://127.0.0.1:5557")
    batch = decode_payload(GOOD)
    w.write_batch(EventBatch(batch.ts, batch.events, 0, batch.encoding, seq=0))
    w.close()
    return str(path)


def prompt_file(tmp: Path, content: str) -> str:
    path = tmp / "prompt.json"
    path.write_text(content)
    return str(path)


def file_with(tmp: Path, name: str, data: bytes) -> str:
    path = tmp / name
    path.write_bytes(data)
    return str(path)


def dead_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


Case = Callable[[Path, RealPublisher], list[str]]

CASES: list[tuple[str, Case, str]] = [
    ("missing capture", lambda t, p: ["replay", str(t / "nope.jsonl")], r"capture .*nope.jsonl does not exist"),
    ("empty capture", lambda t, p: ["replay", file_with(t, "empty.jsonl", b"")], r"is empty"),
    ("truncated capture (inside the header)",
     lambda t, p: ["replay", file_with(t, "cut.jsonl", Path(good_capture(t)).read_bytes()[:40])],
     r"truncated inside its header line"),
    ("garbage capture", lambda t, p: ["diagnose", "--capture", file_with(t, "junk.jsonl", b"\x89PNG\r\n\x1a\n..."),
                                      "--prompt", prompt_file(t, "[1, 2, 3, 4, 5]")], r"not a kvalign capture"),
    ("truncated msgpack frame", lambda t, p: ["replay", "--strict", raw_capture(t, [GOOD, GOOD[:-9]])],
     r"batch seq \d+ is malformed: payload is not valid msgpack"),
    ("unknown event type",
     lambda t, p: ["replay", "--strict", raw_capture(t, [GOOD, GOOD.replace(b"BlockRemoved", b"BlockMissing")])],
     r"is malformed: unknown event type 'BlockMissing'"),
    ("token id negative", lambda t, p: ["diagnose", "--capture", good_capture(t), "--prompt", prompt_file(t, "[1, 2, -1]")],
     r"prompt token at position 2 is out of the u32 range .*: -1"),
    ("token id >= 2^32", lambda t, p: ["diagnose", "--capture", good_capture(t), "--prompt", prompt_file(t, f"[1, {2**32}]")],
     r"prompt token at position 1 is out of the u32 range .*: 4294967296"),
    ("token id not an integer", lambda t, p: ["diagnose", "--capture", good_capture(t), "--prompt", prompt_file(t, "[1, 2.5]")],
     r"prompt token at position 1 is not an integer: 2.5"),
    ("block size 0", lambda t, p: ["diagnose", "--capture", good_capture(t), "--prompt", prompt_file(t, "[1, 2]"),
                                   "--block-size", "0"], r"argument --block-size: must be >= 1, got 0"),
    ("non-JSON prompt", lambda t, p: ["diagnose", "--capture", good_capture(t), "--prompt", prompt_file(t, "hello world")],
     r"is not JSON token ids \(for text, pass --tokenizer DIR\)"),
    ("JSON prompt that is not a list", lambda t, p: ["diagnose", "--capture", good_capture(t),
                                                     "--prompt", prompt_file(t, '{"text": "hi"}')],
     r"must hold a JSON list of token ids"),
    ("unreachable endpoint", lambda t, p: ["capture", "--endpoint", dead_endpoint(), "--out", str(t / "c.jsonl"),
                                           "--timeout", "0.2"], r"cannot reach tcp://127\.0\.0\.1:\d+: no publisher accepted"),
    ("unreachable endpoint (watch)", lambda t, p: ["watch", "--endpoint", dead_endpoint(), "--timeout", "0.5"],
     r"cannot reach tcp://127\.0\.0\.1:\d+"),
    ("malformed endpoint", lambda t, p: ["capture", "--endpoint", "localhost:5557", "--out", str(t / "c.jsonl")],
     r"endpoint must look like tcp://HOST:PORT"),
    ("wrong topic, no traffic within the timeout",
     lambda t, p: ["capture", "--endpoint", p.endpoint, "--topic", "not-kv-events", "--out", str(t / "c.jsonl"),
                   "--timeout", "0.5"],
     r"connected to tcp://127\.0\.0\.1:\d+ but no batch on topic 'not-kv-events' within 0\.5s \(saw \d+ on 'kv-events'"),
    ("--routed-at-batch without --engine-reused",
     lambda t, p: ["diagnose", "--capture", good_capture(t), "--prompt", prompt_file(t, "[1, 2]"), "--routed-at-batch", "3"],
     r"--routed-at-batch needs --engine-reused"),
    ("--engine-reused with two captures",
     lambda t, p: ["diagnose", "--capture", (c := good_capture(t)), "--capture",
                   file_with(t, "second.jsonl", Path(c).read_bytes()), "--prompt",
                   prompt_file(t, "[1, 2]"), "--engine-reused", "16"], r"--engine-reused takes one --capture"),
    ("tokenizer dir missing", lambda t, p: ["diagnose", "--capture", good_capture(t), "--prompt", prompt_file(t, "hi"),
                                            "--tokenizer", str(t / "no-tokenizer")], r"tokenizer directory .* does not exist"),
    ("capture from a newer format version",
     lambda t, p: ["replay", file_with(t, "new.jsonl", json.dumps({"kvalign_capture": FORMAT_VERSION + 1}).encode() + b"\n")],
     rf"uses capture format {FORMAT_VERSION + 1}, newer than this kvalign reads \({FORMAT_VERSION}\); upgrade kvalign"),
    ("output path not writable", lambda t, p: ["capture", "--endpoint", p.endpoint,
                                               "--out", str(Path(good_capture(t)) / "x.jsonl")],
     r"cannot create capture .*: Not a directory"),
    ("existing capture without --force", lambda t, p: ["capture", "--endpoint", p.endpoint, "--out", good_capture(t)],
     r"already exists; refusing to overwrite a capture \(use --force\)"),
    ("bad --worker count", lambda t, p: ["replay", good_capture(t), "--worker", "a", "--worker", "b"],
     r"2 --worker names for 1 captures"),
    ("metrics port out of range", lambda t, p: ["watch", "--endpoint", p.endpoint, "--metrics-port", "70000"],
     r"--metrics-port must be 0\.\.65535, got 70000"),
]


@pytest.mark.parametrize(("kind", "make_argv", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(tmp_path, sglang_publisher, capsys, kind, make_argv, message):
    argv = make_argv(tmp_path, sglang_publisher)
    captures = {p: p.read_bytes() for p in tmp_path.rglob("*.jsonl")}
    capsys.readouterr()
    stop = threading.Event()
    traffic = threading.Thread(target=_publish_until, args=(sglang_publisher, stop), daemon=True)
    traffic.start()  # live traffic on the publisher's own topic, for the wrong-topic row
    try:
        rc = main(argv)
    finally:
        stop.set()
        traffic.join(timeout=5)
    err = capsys.readouterr().err
    assert rc == 2, (kind, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvalign: error: "), err
    assert re.search(message, lines[0]), lines[0]
    for path, data in captures.items():
        assert path.read_bytes() == data, f"{path} changed"
    assert not (tmp_path / "c.jsonl").exists()  # a failed capture leaves no file behind


def _publish_until(publisher: RealPublisher, stop: threading.Event) -> None:
    while not stop.wait(0.05):
        publisher.publish([publisher.warm_up_event()])


def test_the_table_covers_at_least_13_kinds():
    assert len({kind for kind, _, _ in CASES}) >= 13
