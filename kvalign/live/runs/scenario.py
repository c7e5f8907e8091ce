"""The shared live scenario: prefix-extending requests, kvalign's prediction, and the checks.

Modelled on Dynamo's router e2e tests: N sequential streaming chat completions, request i's
content is a base text repeated i+1 times, so each prompt extends the previous one. For each
request kvalign predicts the router's ``kv_hit_rate`` *before* sending it, from its own index
rebuilt from the captured SGLang events (:mod:`kvalign.live.wire.capture`) and its own hashing of
the prompt with the eagle flag the worker registered; the response then says what the router
actually did. Every check is a function raising ``AssertionError`` with the numbers, so the CPU
tests, ``kvalign live`` and the GPU nightly share them verbatim.

Router arithmetic (checked against the live 1.6.1 router): ``kv_hit_rate = overlap_blocks /
ceil(prompt_tokens / B)`` — the denominator counts a partial last block, unlike the number of
hashed blocks (``N // B``, or ``(N-1) // B`` under EAGLE).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from kvalign.live.cluster import ranks
from kvalign.model.hashing import block_hashes
from kvalign.model.index import router_kv_hit_rate
from kvalign.live.wire.client import EXTRA_FIELDS, ChatResult, SseError, stream_chat

#: 18 in-vocabulary words (see :mod:`kvalign.live.cluster.model_dir`): with the chat framing, request 1
#: is 21 tokens (> B+1 = 17, so it holds one EAGLE block at B=16) and each repeat adds 18.
BASE_TEXT = "the quick brown fox jumps over lazy dog a rabbit ran across green field under bright morning sun"


def prefix_prompts(n: int, base: str = BASE_TEXT) -> list[str]:
    """Request i (0-based) is ``base`` repeated i+1 times."""
    return [" ".join([base] * (i + 1)) for i in range(n)]


@cache
def _tokenizer(model_path: str) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(model_path)


def prompt_tokens(model_path: str, content: str) -> list[int]:
    """The prompt token ids the frontend sends for one user message (chat template applied)."""
    out = _tokenizer(model_path).apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(t) for t in ids]


@dataclass
class RequestRecord:
    """One request: what kvalign predicted before it, and what the router reported."""

    index: int
    tokens: list[int]
    router_eagle: bool
    predicted_overlap: dict[tuple[int, int], int]  # (worker id, dp rank) -> leading blocks kvalign's index holds
    result: ChatResult
    block_size: int = 16

    @property
    def worker(self) -> int | None:
        """The worker the router chose at the first hop (prefill in disagg, the worker in agg)."""
        return self.result.prefill_worker_id

    @property
    def source(self) -> tuple[int | None, int]:
        """(worker, data-parallel rank) the router chose: one KV cache (rank 0 without ``--dp-size``)."""
        return self.result.prefill_worker_id, self.result.prefill_dp_rank or 0

    @property
    def isl_blocks(self) -> int:
        return math.ceil(len(self.tokens) / self.block_size)

    @property
    def predicted(self) -> float | None:
        return None if self.worker is None else router_kv_hit_rate(self.predicted_overlap.get(self.source, 0),
                                                                    len(self.tokens), self.block_size)

    @property
    def observed(self) -> float | None:
        return self.result.kv_hit_rate

    def row(self) -> dict[str, Any]:
        t = self.result.timing
        return {
            "request": self.index + 1, "prompt_tokens": len(self.tokens), "isl_blocks": self.isl_blocks,
            "prefill_worker": self.result.prefill_worker_id, "decode_worker": self.result.decode_worker_id,
            **({"prefill_dp_rank": self.result.prefill_dp_rank} if self.result.prefill_dp_rank else {}),
            "kv_hit_rate": self.observed, "predicted": self.predicted,
            "predicted_overlap_blocks": self.predicted_overlap.get(self.source, 0),
            "ttft_ms": t.get("ttft_ms"), "total_time_ms": t.get("total_time_ms"),
        }


def run_prefix_extension(cluster: Any, n: int = 4, *, max_tokens: int = 8, pause_s: float = 1.0,
                         event_wait_s: float = 5.0,
                         after_each: Callable[[RequestRecord], None] | None = None,
                         extra_fields: Sequence[str] = EXTRA_FIELDS, record_errors: bool = False) -> list[RequestRecord]:
    """Send the n prefix-extending requests through ``cluster``, predicting each beforehand.

    After each response it waits (bounded) until the capture has the serving worker's new
    events, then ``pause_s`` for the router to index the same events, as Dynamo's tests do.
    ``after_each`` then sees the request's record (the GPU run scrapes decode metrics there).
    ``extra_fields``: the ``nvext`` fields each response carries (``completion_token_ids`` for a run
    that compares outputs). ``record_errors``: a failed request is recorded (``result.error``) instead
    of raising, for a run whose control makes the engine abort requests.
    """
    b = cluster.plan.topology.page_size
    publishing = {name: h for name, h in cluster.workers.items() if h.kv_events_endpoint}
    # one index per KV cache: (instance, dp rank) of every source (kvalign.live.cluster.ranks)
    ids = {label: (cluster.workers[w.name].instance_id, rank) for label, (w, rank) in ranks.sources(cluster.plan).items()}
    label_of = {key: label for label, key in ids.items()}
    records = []
    for i, content in enumerate(prefix_prompts(n)):
        tokens = prompt_tokens(cluster.plan.model_path, content)
        router_eagle = any(h.enable_eagle for h in publishing.values())
        index = cluster.capture.index(ids, b)
        overlap = index.overlap(block_hashes(tokens, b, eagle=router_eagle))
        before = {name: cluster.capture.count(name) for name in ids}
        try:
            result = stream_chat(cluster.frontend_url, cluster.model, content, max_tokens=max_tokens,
                                 extra_fields=extra_fields)
        except SseError as exc:
            if not record_errors:
                raise
            result = ChatResult(error=str(exc).splitlines()[0])
        records.append(RequestRecord(i, tokens, router_eagle, overlap, result, b))
        label = label_of.get(records[-1].source)
        if label is not None:
            cluster.capture.wait_for(lambda snap, lbl=label: sum(c.label == lbl for c in snap) > before[lbl], event_wait_s)
        time.sleep(pause_s)
        if after_each is not None:
            after_each(records[-1])
    return records


def table(records: list[RequestRecord]) -> str:
    """A fixed-width per-request table for reports and failure messages."""
    head = f"{'req':>3} {'tokens':>6} {'blocks':>6} {'prefill_worker':>20} {'decode_worker':>20} {'kv_hit_rate':>11} {'predicted':>9}"
    lines = [head]
    for r in records:
        row = r.row()
        fmt = lambda v: "None" if v is None else f"{v:.4f}"  # noqa: E731
        worker = f"{row['prefill_worker']}" + (f"/dp{row['prefill_dp_rank']}" if row.get("prefill_dp_rank") else "")
        lines.append(f"{row['request']:>3} {row['prompt_tokens']:>6} {row['isl_blocks']:>6} {worker:>20} "
                     f"{str(row['decode_worker']):>20} {fmt(row['kv_hit_rate']):>11} {fmt(row['predicted']):>9}")
    return "\n".join(lines)


# ---- checks (each raises AssertionError with the table) -------------------------------------

def _fail(msg: str, records: list[RequestRecord]) -> AssertionError:
    return AssertionError(f"{msg}\n{table(records)}")


def check_timing(records: list[RequestRecord]) -> None:
    """Every response carried nvext.timing with ttft_ms > 0 and total_time_ms >= ttft_ms."""
    for r in records:
        t = r.result.timing
        if not t:
            raise _fail(f"request {r.index + 1}: no nvext.timing in the response", records)
        if not (t.get("ttft_ms", 0) > 0 and t.get("total_time_ms", 0) >= t["ttft_ms"]):
            raise _fail(f"request {r.index + 1}: bad timing {t}", records)


def check_prompt_tokens(records: list[RequestRecord]) -> None:
    """kvalign tokenised each prompt to as many tokens as the frontend did (else no prediction holds)."""
    for r in records:
        if r.result.prompt_tokens is None:
            raise _fail(f"request {r.index + 1}: no usage.prompt_tokens in the stream (stream_options.include_usage)", records)
        if r.result.prompt_tokens != len(r.tokens):
            raise _fail(f"request {r.index + 1}: frontend counted {r.result.prompt_tokens} prompt tokens, "
                        f"kvalign {len(r.tokens)} (template/BOS drift)", records)


def check_same_worker(records: list[RequestRecord]) -> int:
    """Requests 2..N went to request 1's (prefill) worker, and to its data-parallel rank; returns the worker."""
    first = records[0].worker
    if first is None:
        raise _fail("request 1: no nvext.worker_id.prefill_worker_id in the response", records)
    others = [r for r in records[1:] if r.source != records[0].source]
    if others:
        where = f"worker {first}" + (f" rank {records[0].source[1]}" if any(r.source[1] for r in records) else "")
        raise _fail(f"requests {[r.index + 1 for r in others]} left request 1's {where}", records)
    return first


def check_not_decode(records: list[RequestRecord], decode_ids: set[int]) -> None:
    """The prefill worker of every request is not a decode worker (disaggregated topologies)."""
    bad = [r for r in records if r.worker in decode_ids]
    if bad:
        raise _fail(f"requests {[r.index + 1 for r in bad]} were prefilled on a decode worker", records)
    if any(r.result.decode_worker_id not in decode_ids for r in records):
        raise _fail(f"decode ran outside the decode workers {sorted(decode_ids)}", records)


def check_hit_positive(records: list[RequestRecord]) -> None:
    """The router saw reusable cache on requests 2..N."""
    bad = [r for r in records[1:] if not (r.observed or 0) > 0]
    if bad:
        raise _fail(f"kv_hit_rate not > 0 on requests {[r.index + 1 for r in bad]}", records)


def check_hit_zero(records: list[RequestRecord]) -> None:
    """Negative control: the router saw no reusable cache on requests 2..N."""
    bad = [r for r in records[1:] if (r.observed or 0) != 0]
    if bad:
        raise _fail(f"kv_hit_rate should stay 0 (cache-blind) but is > 0 on {[r.index + 1 for r in bad]}", records)


def check_prediction(records: list[RequestRecord], tolerance_blocks: int = 1) -> None:
    """kvalign's predicted kv_hit_rate equals the router's within ``tolerance_blocks`` blocks."""
    for r in records:
        if r.observed is None or r.predicted is None:
            raise _fail(f"request {r.index + 1}: missing kv_hit_rate (observed {r.observed}, predicted {r.predicted})", records)
        off = abs(r.observed - r.predicted) * r.isl_blocks
        if off > tolerance_blocks + 1e-9:
            raise _fail(f"request {r.index + 1}: router {r.observed:.4f} vs kvalign {r.predicted:.4f} "
                        f"differ by {off:.2f} blocks (> {tolerance_blocks})", records)


@dataclass(frozen=True)
class LiveDiagnosis:
    """``kvalign diagnose`` of one live request against one worker's capture."""

    worker: str
    report: Any  # kvalign.streams.diagnose.Diagnosis
    cli_args: list[str]
    live_cause: Any = None  # a Cause the live router's own credit shows where the registered settings show none
    live_note: str = ""

    @property
    def cause(self) -> Any:
        return self.live_cause or self.report.cause

    def line(self) -> str:
        r, e = self.report.router, self.report.engine
        head = (f"cause: {self.cause.name} - {self.cause.value}{self.live_note}" if self.cause
                else f"cause: none - {self.report.detail}")
        return (f"{head}; {self.worker}: router eagle {'on' if r['eagle'] else 'off'} overlap {r['overlap']}/{r['blocks']}, "
                f"engine eagle {'on' if e['eagle'] else 'off'} overlap {e['overlap']}/{e['blocks']}")


def _diagnose_on(cluster: Any, record: RequestRecord, label: str) -> LiveDiagnosis:
    from kvalign.streams.diagnose import RouterSettings
    from kvalign.streams.diagnose import diagnose as run_diagnose

    handle = cluster.workers[ranks.split_label(label)[0]]
    path = cluster.capture.capture_path(label)
    if path is None:
        raise ValueError(f"no kvalign capture was recorded for {label}")
    b, eagle = cluster.plan.topology.page_size, "on" if handle.enable_eagle else "off"
    report = run_diagnose(path, record.tokens, RouterSettings(block_size=b, eagle=eagle))
    prompt = Path(path).with_name(f"request{record.index + 1}.prompt.json")
    prompt.write_text(json.dumps(record.tokens))
    args = ["diagnose", "--capture", path, "--prompt", str(prompt), "--block-size", str(b), "--router-eagle", eagle]
    return _live_router_differs(LiveDiagnosis(label, report, args), record, path, b)


def _live_router_differs(found: LiveDiagnosis, record: RequestRecord, capture: str, block_size: int) -> LiveDiagnosis:
    """Where the registered card and the engine agree but the live router credited something else,
    ask which eagle setting the live router's credit matches: a router that hashes plain blocks
    although every worker registered ``enable_eagle`` is ROUTER_EAGLE_OFF even with a right card
    (Dynamo #11764: the prefill router built its KV chooser with eagle off, whatever the card said)."""
    from kvalign.model.causes import Cause
    from kvalign.streams.diagnose import RouterSettings
    from kvalign.streams.diagnose import diagnose as run_diagnose

    if found.report.cause is not None or record.observed is None:
        return found
    credited = round(record.observed * record.isl_blocks)
    registered = found.report.router
    if credited == registered["overlap"]:
        return found
    flipped = run_diagnose(capture, record.tokens,
                           RouterSettings(block_size=block_size, eagle="off" if registered["eagle"] else "on"))
    if flipped.router["overlap"] != credited:
        return found
    cause = Cause.ROUTER_EAGLE_OFF if registered["eagle"] else Cause.ROUTER_EAGLE_ON
    note = (f" (the card registered enable_eagle={registered['eagle']}, but the live router credited {credited} "
            f"blocks, what a router with eagle {'off' if registered['eagle'] else 'on'} credits: it does not hash as "
            "the card says)")
    return LiveDiagnosis(found.worker, found.report, found.cli_args, cause, note)


def diagnose(cluster: Any, record: RequestRecord, worker: int | None = None) -> LiveDiagnosis:
    """Why the router credited ``record`` with the overlap it did, by ``kvalign diagnose``.

    Router settings are what the worker *registered* (``enable_eagle`` from its model card) and
    the router's block size; the engine side is the worker's live capture. ``worker`` (an
    instance id) picks the capture; by default the publishing worker that actually holds most of
    the prompt — the cache the router should have seen (blind routing scatters requests, so the
    serving worker may hold nothing).
    """
    key = {label: (cluster.workers[w.name].instance_id, rank) for label, (w, rank) in ranks.sources(cluster.plan).items()}
    labels = [n for n in key if cluster.capture.capture_path(n) and cluster.capture.count(n)]
    if worker is not None:
        labels = [n for n in labels if key[n][0] == worker]
        if not labels:
            raise ValueError(f"request {record.index + 1}: worker {worker} has no captured events")
    served = [n for n in labels if key[n] == record.source]
    found = [_diagnose_on(cluster, record, n) for n in served + [n for n in labels if n not in served]]
    if not found:
        raise ValueError("no worker published any KV event to diagnose against")
    return max(found, key=lambda d: d.report.engine["overlap"])  # first (served) wins ties
