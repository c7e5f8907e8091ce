"""The capture file: a versioned JSONL record of one SGLang worker's KV-event stream.

A capture is evidence, so it must survive the way people stop tools (Ctrl-C, ``kill -9``, a full
disk) and never overwrite an earlier one:

* line 1 is a header (format version, detected SGLang wire encoding, endpoint, topic, start time,
  block size when known); every other line is one received batch with its sequence number;
* each line goes to the kernel with one ``os.write`` of the whole line, newline included, as soon
  as the batch arrives, so an interrupted capture ends on a complete line (a hard kill can at
  worst leave a partial last line, which the reader reports and skips);
* the file is created with ``O_EXCL`` unless the user forces an overwrite.

Events are stored decoded and normalised — not as the raw msgpack — because replay must run at
millions of blocks per second in Python: each ``BlockStored`` keeps its raw token window as one
base64 string of little-endian u32 (exactly the bytes the router hashes), so replay hashes slices
of it without creating a Python int per token; engine block hashes are base64 of little-endian
u64 (how Dynamo reads SGLang's signed int64), decoded with one C call per event. EAGLE bigram pages are stored as that flattened
window plus ``pairs: true`` (Dynamo's own flattening: all first elements, then the last second).
Anything this form cannot hold losslessly (pairs that do not chain, token ids outside u32) falls
back to plain JSON in ``tok``; a batch that does not decode at all is kept as its raw payload with
the reason, so nothing that arrived is lost.
"""

from __future__ import annotations

import os
import sys
import time
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Annotated, Any

import msgspec

from kvalign.errors import UsageError
from kvalign.model.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, EventDecodeError, KVEvent, decode_frames
from kvalign.model.hashing import U64_MASK
from kvalign.streams.sequence import SequenceTracker
from kvalign.model.sglang_keys import is_bigram_payload

FORMAT_VERSION = 1
ENCODING_RELEASES = {"positional": "sglang <= 0.5.19 (positional events)", "map": "sglang >= 0.5.23 (tagged-map events)"}

assert array("I").itemsize == 4, "kvalign needs a 4-byte unsigned int array type"


#: A block size a capture line may carry: larger ones cannot be real (no prompt has 2^32 tokens)
#: and would overflow the replay's int64 arithmetic, so such a line is damage, counted like any other.
BlockSize = Annotated[int, msgspec.Meta(le=2**32)]


class CaptureError(UsageError):
    """A capture file that cannot be read or written; the message is one line for the user."""


class Header(msgspec.Struct, kw_only=True):
    """First line of a capture."""

    kvalign_capture: int
    encoding: str | None = None
    sglang: str | None = None
    endpoint: str | None = None
    topic: str | None = None
    started: str | None = None
    started_unix: float | None = None
    block_size: BlockSize | None = None


class Stored(msgspec.Struct, tag_field="k", tag="stored", kw_only=True, omit_defaults=True, gc=False):
    """A ``BlockStored``: ``h`` engine hashes (u64 LE), ``p`` parent (u64), ``t`` raw tokens (u32 LE).

    ``tok`` is the lossless fallback for tokens ``t`` cannot hold.
    """

    h: bytes
    p: int | None = None
    bs: BlockSize
    t: bytes = b""
    pairs: bool = False
    tok: list[Any] | None = None
    lid: int | None = None
    m: str | None = None
    salt: str | None = None
    lora: str | None = None
    sid: str | None = None

    def __post_init__(self) -> None:
        """A parent is stored as ``h & U64_MASK``: one outside u64 is a line no writer produced,
        rejected as malformed when read rather than overflowing an index later. (msgspec's own
        bounds stop at int64, so the check is here.)"""
        if self.p is not None and not 0 <= self.p <= U64_MASK:
            raise ValueError(f"parent hash {self.p} is outside u64")


class Removed(msgspec.Struct, tag_field="k", tag="removed", kw_only=True, omit_defaults=True, gc=False):
    h: bytes  # engine hashes, u64 LE
    m: str | None = None


class Cleared(msgspec.Struct, tag_field="k", tag="cleared", gc=False):
    pass


CompactEvent = Stored | Removed | Cleared


class Batch(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One received batch: decoded events, or ``bad`` + ``raw`` when it did not decode."""

    seq: int | None = None
    t: float = 0.0
    ts: float | None = None
    rank: int | None = None
    ev: list[CompactEvent] = []
    bad: str | None = None
    raw: bytes | None = None


_encode = msgspec.json.Encoder().encode
_decode_batch = msgspec.json.Decoder(Batch).decode
_LITTLE = sys.byteorder == "little"


def _u32_bytes(tokens: list[int]) -> bytes | None:
    """Little-endian u32 bytes of ``tokens``, or None when one does not fit in u32."""
    try:
        arr = array("I", tokens)
    except OverflowError:
        return None
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def pack_u64(hashes: list[int]) -> bytes:
    """Engine hashes (signed int64 or u64) as little-endian u64 bytes."""
    arr = array("Q", [h & U64_MASK for h in hashes])
    if not _LITTLE:
        arr.byteswap()
    return arr.tobytes()


def u64_list(data: bytes) -> list[int]:
    """The u64 engine hashes packed by :func:`pack_u64`."""
    arr = array("Q")
    arr.frombytes(data)
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


def n_blocks(ev: Stored | Removed) -> int:
    return len(ev.h) // 8


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def _chained(pairs: list[Any]) -> bool:
    return all(pairs[i][1] == pairs[i + 1][0] for i in range(len(pairs) - 1))


def compact_event(ev: KVEvent) -> CompactEvent:
    """The capture form of one decoded event (lossless)."""
    if isinstance(ev, BlockRemoved):
        return Removed(h=pack_u64(ev.block_hashes), m=ev.medium)
    if isinstance(ev, AllBlocksCleared):
        return Cleared()
    tokens = ev.token_ids
    raw: bytes | None
    pairs = is_bigram_payload(tokens)
    if pairs:
        raw = _u32_bytes([int(p[0]) for p in tokens] + [int(tokens[-1][1])]) if _chained(tokens) else None
    else:
        raw = _u32_bytes(list(tokens))
    fallback = None if raw is not None else [list(t) if isinstance(t, (list, tuple)) else t for t in tokens]
    return Stored(
        h=pack_u64(ev.block_hashes), p=None if ev.parent_block_hash is None else ev.parent_block_hash & U64_MASK,
        bs=ev.block_size, t=raw or b"", pairs=pairs,
        tok=fallback, lid=ev.lora_id, m=ev.medium, salt=ev.cache_salt, lora=ev.lora_name, sid=ev.session_id,
    )


def stored_units(ev: Stored) -> list[Any]:
    """The event's ``token_ids`` as SGLang sent them (ints, or ``(a, b)`` bigram pairs)."""
    if ev.tok is not None:
        return [tuple(t) if isinstance(t, list) else t for t in ev.tok]
    arr = array("I")
    arr.frombytes(ev.t)
    if not _LITTLE:
        arr.byteswap()
    toks = arr.tolist()
    return [(toks[i], toks[i + 1]) for i in range(len(toks) - 1)] if ev.pairs else toks


def expand_event(ev: CompactEvent) -> KVEvent:
    """Back to :mod:`kvalign.model.events` form, hashes signed as SGLang sends them (display, reference relay)."""
    if isinstance(ev, Removed):
        return BlockRemoved([_signed(h) for h in u64_list(ev.h)], ev.m)
    if isinstance(ev, Cleared):
        return AllBlocksCleared()
    return BlockStored(
        block_hashes=[_signed(h) for h in u64_list(ev.h)], parent_block_hash=None if ev.p is None else _signed(ev.p),
        token_ids=stored_units(ev), block_size=ev.bs,
        lora_id=ev.lid, medium=ev.m, cache_salt=ev.salt, lora_name=ev.lora, session_id=ev.sid,
    )


def first_block_size(events: list[KVEvent]) -> int | None:
    return next((ev.block_size for ev in events if isinstance(ev, BlockStored)), None)


@dataclass
class WriteStats:
    """What a capture has written so far (for the closing summary)."""

    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    malformed: int = 0
    seq: SequenceTracker = field(default_factory=SequenceTracker)

    def summary(self) -> str:
        seq = self.seq
        span = f"seq {seq.first}..{seq.last}" if seq.first is not None else "no sequence numbers"
        gaps = f"{len(seq.gaps)} gaps ({seq.missing_batches} batches missing: {seq.describe_gaps()})" if seq.gaps else "0 gaps"
        return (f"{self.batches} batches ({span}), {self.events} events, {self.blocks_stored} blocks stored, "
                f"{self.blocks_removed} removed, {gaps}, {len(seq.restarts)} restarts, {self.malformed} malformed")


class CaptureWriter:
    """Appends batches to a new capture file, one complete line per ``os.write``.

    The file is claimed (created) at once, so a name clash fails before any waiting; the header
    is written with the first batch, because only then are the encoding and block size known.
    """

    def __init__(self, path: str, *, force: bool = False, endpoint: str | None = None, topic: str | None = None):
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        flags |= os.O_TRUNC if force else os.O_EXCL
        try:
            self._fd: int | None = os.open(path, flags, 0o644)
        except FileExistsError:
            raise CaptureError(f"{path} already exists; refusing to overwrite a capture (use --force)") from None
        except OSError as exc:
            raise CaptureError(f"cannot create capture {path}: {exc.strerror or exc}") from None
        self.path = path
        self.endpoint, self.topic = endpoint, topic
        self.started = time.time()
        self.stats = WriteStats()

    def _write_line(self, obj: msgspec.Struct) -> None:
        if self._fd is None:
            raise CaptureError(f"capture {self.path} is closed")
        data = memoryview(_encode(obj) + b"\n")
        while data:  # os.write may be short on a full disk or a signal; finish the line
            try:
                n = os.write(self._fd, data)
            except OSError as exc:
                raise CaptureError(f"cannot write capture {self.path}: {exc.strerror or exc}") from None
            data = data[n:]

    def _header(self, encoding: str | None, block_size: int | None) -> None:
        self._write_line(Header(
            kvalign_capture=FORMAT_VERSION, encoding=encoding, sglang=ENCODING_RELEASES.get(encoding or ""),
            endpoint=self.endpoint, topic=self.topic,
            started=datetime.fromtimestamp(self.started, timezone.utc).isoformat(timespec="milliseconds"),
            started_unix=round(self.started, 6), block_size=block_size,
        ))

    def write_batch(self, batch: EventBatch, received: float | None = None) -> None:
        """Record one decoded batch."""
        if self.stats.batches == 0:
            self._header(batch.encoding if batch.events else None, first_block_size(batch.events))
        self._write_line(Batch(seq=batch.seq, t=round(received or time.time(), 6), ts=batch.ts, rank=batch.dp_rank,
                               ev=[compact_event(e) for e in batch.events]))
        s = self.stats
        s.batches += 1
        s.events += len(batch.events)
        s.blocks_stored += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockStored))
        s.blocks_removed += sum(len(e.block_hashes) for e in batch.events if isinstance(e, BlockRemoved))
        s.seq.observe(batch.seq)

    def write_bad(self, seq: int | None, reason: str, raw: bytes, received: float | None = None) -> None:
        """Record a batch that did not decode, with its payload, so the evidence is kept."""
        if self.stats.batches == 0:
            self._header(None, None)
        self._write_line(Batch(seq=seq, t=round(received or time.time(), 6), bad=reason, raw=raw))
        self.stats.batches += 1
        self.stats.malformed += 1
        self.stats.seq.observe(seq)

    def write_frames(self, frames: list[bytes], received: float | None = None) -> bool:
        """Record one ZMQ multipart message as it arrived; False when it is not a batch (skipped).

        Untrusted bytes: anything that does not decode is kept as a ``bad`` line with its payload
        and reason, never raised. A negative sequence number is SGLang's end-of-replay marker.
        """
        try:
            batch = decode_frames(frames)
        except EventDecodeError as exc:
            seq = int.from_bytes(frames[1], "big", signed=True) if len(frames) == 3 and len(frames[1]) == 8 else None
            self.write_bad(seq, str(exc), frames[-1] if frames else b"", received)
            return True
        if batch.seq is not None and batch.seq < 0:
            return False
        self.write_batch(batch, received)
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def discard_if_empty(self) -> bool:
        """Remove the claimed file when nothing was written; True if it was removed."""
        self.close()
        if self.stats.batches == 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            return True
        return False


@dataclass
class ReadIssues:
    """Damage the reader skipped, reported to the user rather than raised."""

    partial_tail_bytes: int = 0
    bad_lines: int = 0
    first_bad_line: tuple[int, str] | None = None

    def describe(self, path: str) -> list[str]:
        out = []
        if self.partial_tail_bytes:
            out.append(f"{path}: ignored a partial last line ({self.partial_tail_bytes} bytes; the capture was killed mid-write)")
        if self.bad_lines:
            ln, why = self.first_bad_line or (0, "")
            out.append(f"{path}: skipped {self.bad_lines} unreadable lines (first: line {ln}: {why})")
        return out


class CaptureReader:
    """Reads a capture: validates the header at open, streams batch lines on demand."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._f = open(path, "rb")  # noqa: SIM115 - closed by close()/__exit__
        except FileNotFoundError:
            raise CaptureError(f"capture {path} does not exist") from None
        except IsADirectoryError:
            raise CaptureError(f"capture {path} is a directory, not a file") from None
        except OSError as exc:
            raise CaptureError(f"cannot open capture {path}: {exc.strerror or exc}") from None
        self.issues = ReadIssues()
        self.header = self._read_header()
        self._line_no = 1

    def _read_header(self) -> Header:
        line = self._f.readline()
        if not line:
            raise CaptureError(f"capture {self.path} is empty (it was stopped before any batch arrived)")
        if not line.endswith(b"\n"):
            raise CaptureError(f"capture {self.path} is truncated inside its header line")
        try:
            raw = msgspec.json.decode(line)
        except msgspec.DecodeError:
            raise CaptureError(f"{self.path} is not a kvalign capture (its first line is not a JSON header)") from None
        version = raw.get("kvalign_capture") if isinstance(raw, dict) else None
        if not isinstance(version, int) or isinstance(version, bool) or version < 1:
            raise CaptureError(f"{self.path} is not a kvalign capture (no capture format version in its header)")
        if version > FORMAT_VERSION:
            raise CaptureError(f"{self.path} uses capture format {version}, newer than this kvalign reads "
                               f"({FORMAT_VERSION}); upgrade kvalign")
        try:
            return msgspec.convert(raw, Header)
        except msgspec.ValidationError as exc:
            raise CaptureError(f"{self.path} has a malformed capture header ({exc})") from None

    def batches(self) -> Iterator[Batch]:
        """Every readable batch line in order; damaged lines are counted in :attr:`issues`."""
        issues = self.issues
        for line in self._f:
            self._line_no += 1
            if not line.endswith(b"\n"):
                issues.partial_tail_bytes = len(line)
                break
            try:
                yield _decode_batch(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                issues.bad_lines += 1
                if issues.first_bad_line is None:
                    issues.first_bad_line = (self._line_no, str(exc).splitlines()[0][:120])

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "CaptureReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def capture_block_size(path: str) -> int | None:
    """The engine block size: the header's, else the first stored event's (None if none).

    Values below 1 cannot come from SGLang (a damaged or hand-edited file) and are passed over.
    """
    with CaptureReader(path) as reader:
        if reader.header.block_size is not None and reader.header.block_size >= 1:
            return reader.header.block_size
        for batch in reader.batches():
            for ev in batch.ev:
                if isinstance(ev, Stored) and ev.bs >= 1:
                    return ev.bs
    return None
