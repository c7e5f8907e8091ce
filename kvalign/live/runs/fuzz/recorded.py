"""A failure named from the stream recorded for it, not from the live cluster's timing.

When a request's engine reused pages that kvalign's engine view did not hold at the routing mark,
the worker's engine-side stream since the example began (SGLang's own batches, byte for byte from
the hop's tap) is written as a kvalign capture beside the failure, with the prompt, and the cause
is named by replaying that file (:func:`kvalign.streams.engine_reuse.explain_engine_reuse`). The
same replay runs offline::

    kvalign diagnose --capture failures/request-N/engine.capture.jsonl --prompt failures/request-N/prompt.json \\
        --engine-reused TOKENS --routed-at-batch K

so a failure that depends on timing (the engine published its stores after the request was
routed, and a live replay of the steps does not reproduce it) still has its cause and its evidence,
``ENGINE_EVENTS_LATE``, instead of a bare "flaky".
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvalign.model.events import EventBatch
from kvalign.streams.capture import CaptureWriter
from kvalign.streams.engine_reuse import explain_engine_reuse, read_capture

ENGINE_CAPTURE = "engine.capture.jsonl"
PROMPT = "prompt.json"


def record_engine_stream(failures: Path, request: int, batches: Sequence[EventBatch], tokens: Sequence[int]) -> Path:
    """Write ``batches`` (one worker's, from a point where its cache was empty) and the prompt under
    ``failures/request-N`` (``request-N.2``, ... when an earlier driver of the same run dir used it)."""
    directory, n = failures / f"request-{request}", 1
    while directory.exists():
        n += 1
        directory = failures / f"request-{request}.{n}"
    directory.mkdir(parents=True)
    (directory / PROMPT).write_text(json.dumps(list(tokens)))
    path = directory / ENGINE_CAPTURE
    writer = CaptureWriter(str(path), force=True)
    try:
        for batch in batches:
            writer.write_batch(batch)
    finally:
        writer.close()
    return path


def engine_cause(path: Path, tokens: Sequence[int], engine_tokens: int, block_size: int, *, eagle: bool,
                 routed_at: int, salt: str | None = None) -> tuple[str, dict[str, Any]] | None:
    """The engine's-events cause replayed from the recorded stream at ``path`` (None when that stream
    held every page the engine reused when the request was routed), with its evidence."""
    batches = read_capture(str(path)) if path.stat().st_size else []
    found = explain_engine_reuse(batches, tokens, engine_tokens, block_size, eagle=eagle, routed_at=routed_at,
                                 namespace=salt)
    if found is None:
        return None
    prompt = path.parent / PROMPT
    replay = (f"kvalign diagnose --capture {path} --prompt {prompt} --engine-reused {engine_tokens} "
              f"--routed-at-batch {routed_at}" + (f" --namespace {salt}" if salt else ""))
    return found.cause.name, {**found.as_json(), "capture": str(path), "prompt": str(prompt),
                              "routed_at_batch": routed_at, "replay": replay}
