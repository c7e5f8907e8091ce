"""The capture file: both SGLang wire encodings, lossless events, kill-safety, refusal to overwrite."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sglang_publisher import RECORDED, RealPublisher, captured, raw_capture, sglang_publisher  # noqa: F401

from kvalign.streams.capture import (
    FORMAT_VERSION, Batch, CaptureError, CaptureReader, CaptureWriter, Stored, compact_event, expand_event, n_blocks,
)
from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_payload
from kvalign.oracles.sglang import SglangRadixCache

B = 4


def _norm(ev):
    """Pairs as tuples: the wire decoder gives lists, SGLang's own objects tuples."""
    if isinstance(ev, BlockStored):
        return dataclasses.replace(ev, token_ids=[tuple(t) if isinstance(t, list) else t for t in ev.token_ids])
    return ev


@pytest.mark.parametrize(("version", "eagle"), list(RECORDED), ids=[f"{v}-{'eagle' if e else 'plain'}" for v, e in RECORDED])
def test_recorded_wire_payloads_are_captured_with_their_encoding(tmp_path, version, eagle):
    payload = bytes.fromhex(RECORDED[(version, eagle)])
    path = raw_capture(tmp_path, [payload, payload])
    with CaptureReader(path) as reader:
        header = reader.header
        batches = list(reader.batches())
    assert header.kvalign_capture == FORMAT_VERSION and header.block_size == B
    assert header.encoding == ("positional" if version == "0.5.19" else "map")
    assert header.sglang.startswith("sglang <= 0.5.19" if version == "0.5.19" else "sglang >= 0.5.23")
    assert [b.seq for b in batches] == list(range(batches[0].seq, batches[0].seq + len(batches)))
    expected = decode_payload(payload).events
    assert [_norm(expand_event(e)) for e in batches[-1].ev] == [_norm(e) for e in expected]  # lossless
    stored = batches[-1].ev[1]
    assert isinstance(stored, Stored) and stored.pairs is eagle and stored.tok is None
    assert len(stored.t) == 4 * (8 + eagle)  # raw window as u32: 8 tokens, +1 for the bigram tail


def test_real_publisher_capture_header_and_events(tmp_path, sglang_publisher):
    cache = SglangRadixCache(B, eagle=True)
    with captured(tmp_path, sglang_publisher) as stream:
        cache.insert(list(range(1, 11)), cache_salt="s1")
        seq = stream.publish(cache.take_raw_events())
    with CaptureReader(stream.path) as reader:
        h = reader.header
        batches = list(reader.batches())
    assert h.encoding == "map" and h.endpoint == sglang_publisher.endpoint and h.topic == "kv-events"
    assert h.started and h.started_unix > 0 and h.block_size is None  # first batch is the warm-up clear
    last = batches[-1]
    assert last.seq == seq and last.rank == 0
    (ev,) = last.ev
    assert ev.salt == "s1" and ev.pairs and ev.bs == B and n_blocks(ev) == 2
    assert expand_event(ev).token_ids == [(i, i + 1) for i in range(1, 9)]


@st.composite
def stored_events(draw):
    n = draw(st.integers(0, 3))
    bs = draw(st.integers(1, 3))
    kind = draw(st.sampled_from(["flat", "pairs", "broken-pairs", "wide"]))
    units = n * bs
    if kind == "flat":
        tokens = draw(st.lists(st.integers(0, 2**32 - 1), min_size=units, max_size=units))
    elif kind == "wide":
        tokens = draw(st.lists(st.integers(0, 2**40), min_size=units, max_size=units))
    else:
        raw = draw(st.lists(st.integers(0, 2**32 - 1), min_size=units + 1, max_size=units + 1))
        tokens = [(raw[i], raw[i + 1]) for i in range(units)]
        if kind == "broken-pairs" and units > 1:
            tokens[0] = (tokens[0][0], tokens[0][1] + 1)
    return BlockStored(
        block_hashes=draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n, unique=True)),
        parent_block_hash=draw(st.none() | st.integers(-(2**63), 2**63 - 1)), token_ids=tokens, block_size=bs,
        lora_id=draw(st.none() | st.integers(0, 9)), medium=draw(st.none() | st.just("GPU")),
        cache_salt=draw(st.none() | st.text(max_size=3)), lora_name=draw(st.none() | st.text(max_size=3)),
        session_id=draw(st.none() | st.just("s")),
    )


events = stored_events() | st.builds(BlockRemoved, st.lists(st.integers(-(2**63), 2**63 - 1)), st.none() | st.just("GPU")) \
    | st.just(AllBlocksCleared())


@given(st.lists(events, max_size=4))
def test_events_round_trip_losslessly_through_a_line(count_case, evs):
    count_case()
    line = msgspec.json.encode(Batch(seq=1, ev=[compact_event(e) for e in evs]))
    back = msgspec.json.decode(line, type=Batch)
    assert [_norm(expand_event(e)) for e in back.ev] == [_norm(e) for e in evs]


def test_never_overwrites_without_force(tmp_path):
    path = tmp_path / "cap.jsonl"
    path.write_text("precious\n")
    with pytest.raises(CaptureError, match="already exists"):
        CaptureWriter(str(path))
    assert path.read_text() == "precious\n"
    w = CaptureWriter(str(path), force=True)
    w.write_batch(EventBatch(1.0, [AllBlocksCleared()], 0, "map", seq=0))
    w.close()
    with CaptureReader(str(path)) as reader:
        assert [b.seq for b in reader.batches()] == [0]


def _write(path, n: int) -> None:
    w = CaptureWriter(str(path))
    for seq in range(n):
        w.write_batch(EventBatch(1.0, [BlockRemoved([seq])], 0, "map", seq=seq))
    w.close()


def test_reader_tolerates_and_reports_a_partial_last_line(tmp_path):
    path = tmp_path / "cap.jsonl"
    _write(path, 3)
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # a kill -9 in the middle of the last write
    with CaptureReader(str(path)) as reader:
        assert [b.seq for b in reader.batches()] == [0, 1]
        assert reader.issues.partial_tail_bytes == len(data.splitlines()[-1]) - 6
        assert "partial last line" in reader.issues.describe(str(path))[0]


def test_reader_skips_and_counts_unreadable_lines(tmp_path):
    path = tmp_path / "cap.jsonl"
    _write(path, 2)
    with open(path, "ab") as f:
        f.write(b"{not json\n")
        f.write(msgspec.json.encode(Batch(seq=2, ev=[])) + b"\n")
    with CaptureReader(str(path)) as reader:
        assert [b.seq for b in reader.batches()] == [0, 1, 2]
        assert reader.issues.bad_lines == 1 and reader.issues.first_bad_line[0] == 4


def test_refuses_a_newer_format_version(tmp_path):
    path = tmp_path / "future.jsonl"
    path.write_text(json.dumps({"kvalign_capture": FORMAT_VERSION + 1}) + "\n")
    with pytest.raises(CaptureError, match=f"capture format {FORMAT_VERSION + 1}, newer"):
        CaptureReader(str(path))


def _capture_process(endpoint: str, out: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvalign", "capture", "--endpoint", endpoint, "--out", out,
                             "--timeout", "30"], stderr=subprocess.PIPE, text=True)


def _stream_until(proc: subprocess.Popen, path: str, publisher: RealPublisher, lines: int, timeout_s: float = 30.0) -> None:
    """Publish real cache batches (large ones) until ``path`` holds ``lines`` lines."""
    cache = SglangRadixCache(16, eagle=True)
    deadline = time.monotonic() + timeout_s
    n = 0
    while not os.path.exists(path) or open(path, "rb").read().count(b"\n") < lines:
        assert time.monotonic() < deadline and proc.poll() is None, "capture did not record"
        cache.insert([n, *range(1000, 1000 + 2048)])
        publisher.publish(cache.take_raw_events() or [publisher.warm_up_event()])
        n += 1
        time.sleep(0.005)


@pytest.mark.timeout(120)
def test_kill_9_mid_stream_leaves_a_parseable_capture(tmp_path, sglang_publisher):
    path = str(tmp_path / "killed.jsonl")
    proc = _capture_process(sglang_publisher.endpoint, path)
    try:
        _stream_until(proc, path, sglang_publisher, 20)
        for _ in range(20):  # keep publishing while the kill lands
            sglang_publisher.publish([sglang_publisher.warm_up_event()])
        proc.kill()
    finally:
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL
    with CaptureReader(path) as reader:
        batches = list(reader.batches())
        assert reader.issues.bad_lines == 0
    assert len(batches) >= 19 and reader.header.encoding == "map"
    seqs = [b.seq for b in batches]
    assert seqs == sorted(seqs)
    assert all(isinstance(e, Stored) and len(e.t) == 4 * (16 * n_blocks(e) + 1) for b in batches for e in b.ev if isinstance(e, Stored))
    before = open(path, "rb").read()
    rc = subprocess.run([sys.executable, "-m", "kvalign", "capture", "--endpoint", sglang_publisher.endpoint,
                         "--out", path, "--timeout", "1"], capture_output=True, text=True).returncode
    assert rc == 2 and open(path, "rb").read() == before  # a re-run never overwrites it


@pytest.mark.timeout(120)
def test_ctrl_c_ends_a_capture_cleanly_with_a_summary(tmp_path, sglang_publisher):
    path = str(tmp_path / "interrupted.jsonl")
    proc = _capture_process(sglang_publisher.endpoint, path)
    try:
        _stream_until(proc, path, sglang_publisher, 5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "batches (seq" in err and "Traceback" not in err
    with CaptureReader(path) as reader:
        assert len(list(reader.batches())) >= 4 and reader.issues.partial_tail_bytes == 0

