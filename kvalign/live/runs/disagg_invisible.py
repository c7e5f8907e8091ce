"""Disaggregation is invisible: what the decode half of a prefill/decode run must show, and why it
failed when it does not.

A disaggregated EAGLE deployment is right only if handing a request from prefill to decode changes
nothing a client can see: for the same prompts, greedy, the 2P+1D cluster's output token ids equal
one aggregated worker's, request by request, and so does the decode side's speculation (verify
steps and tokens generated over each request, from SGLang's own counters). With kvalign's
KV-dependent pair (:mod:`kvalign.live.engines.engine_model`, ``pair="kv"``) the target's output
depends on every page of the prompt's KV and the draft's acceptance on its own state, so a transfer
that moves nothing, corrupts a page or loses the draft's state changes one of them.

Beneath the comparison, the transfer's own surfaces say whether it happened: the prefill workers'
``sglang:kv_transfer_total_mb`` / ``sglang:kv_transfer_latency_ms`` histograms (one observation per
request a real backend sent) and SGLang's KV checksum on decode (each verification recorded by
:mod:`kvalign.standins.sglang_cpu.kv_transfer`). They name the cause of a divergence
(:data:`kvalign.model.causes.Cause`): no transfer -> ``KV_NOT_TRANSFERRED``, a failed checksum ->
``KV_CHECKSUM_MISMATCH``, equal output with fewer accepted draft tokens ->
``DRAFT_STATE_NOT_TRANSFERRED``, and a verified transfer with other output ->
``DECODE_OUTPUT_DIVERGED``. Every function here is pure: the scenario and the fuzz record, this
module judges, and unit tests feed it recorded runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvalign.model.causes import Cause


@dataclass(frozen=True)
class DecodeRecord:
    """One request as the worker that decoded it answered it: its output and the speculation behind it
    (deltas of SGLang's counters over the request; None where the counter was not scraped)."""

    request: int  # 1-based, the order the requests were sent in
    token_ids: tuple[int, ...]
    verify_calls: float | None = None  # Δ sglang:spec_verify_calls_total
    generation_tokens: float | None = None  # Δ sglang:generation_tokens_total
    error: str | None = None  # the request failed (e.g. SGLang aborted it on a checksum mismatch)


@dataclass(frozen=True)
class TransferRecord:
    """What the prefill->decode hand-off of one request showed on the engines' own surfaces."""

    request: int
    backend: str
    transfers: int  # Δ observations of sglang:kv_transfer_total_mb over the prefill workers
    megabytes: float  # Δ sum of sglang:kv_transfer_total_mb
    latency_ms: float | None  # Δ sum of sglang:kv_transfer_latency_ms (None: not observed)
    checksums: tuple[bool, ...] = ()  # SGLang's verifications on decode during the request (True: digest matched)
    checksum_tokens: int = 0  # tokens those verifications digested
    exported: bool = True  # a prefill worker exports sglang:kv_transfer_total_mb at all (only after a first transfer)

    @property
    def bytes_moved(self) -> int:
        return round(self.megabytes * 2**20)

    @property
    def verified(self) -> bool:
        return bool(self.checksums) and all(self.checksums)


@dataclass(frozen=True)
class Divergence:
    """One request on which disaggregation was visible (or the transfer under it did not happen)."""

    request: int
    what: str
    cause: Cause

    def line(self) -> str:
        return f"request {self.request}: {self.what} - cause: {self.cause.name} - {self.cause.value}"


def transfer_failures(transfers: Sequence[TransferRecord], *, checksum: bool) -> list[Divergence]:
    """Each request whose KV did not move (no transfer observed, or no byte), and with ``checksum``
    (both engines run ``--disaggregation-enable-kv-checksum``) each one SGLang did not verify."""
    out = []
    for t in transfers:
        if t.transfers < 1 or t.bytes_moved <= 0:
            seen = (f"{t.transfers} transfer(s), {t.bytes_moved} bytes" if t.exported else
                    "never observed on any prefill worker")
            out.append(Divergence(t.request, f"no KV moved on the {t.backend} backend (sglang:kv_transfer_total_mb: "
                                             f"{seen})", Cause.KV_NOT_TRANSFERRED))
        elif checksum and not t.checksums:
            out.append(Divergence(t.request, "SGLang's KV checksum verified nothing on decode",
                                  Cause.KV_NOT_TRANSFERRED))
        elif checksum and not t.verified:
            out.append(Divergence(t.request, f"SGLang's KV checksum failed on decode ({t.checksums.count(False)} of "
                                             f"{len(t.checksums)} verification(s))", Cause.KV_CHECKSUM_MISMATCH))
    return out


def invisible_failures(disagg: Sequence[DecodeRecord], aggregated: Sequence[DecodeRecord],
                       transfers: Sequence[TransferRecord] = ()) -> list[Divergence]:
    """Each request whose disaggregated answer differs from the aggregated worker's, with its cause.

    Requests are paired by their number; a request missing on either side is a divergence too (a
    recorded run that lost one cannot be called equal). Token ids are compared first; where they are
    equal, the decode side's verify steps and generated tokens must be too (a draft that lost its
    state needs more verify steps for the same output). Missing counters are an error naming them,
    never equality."""
    agg = {r.request: r for r in aggregated}
    dis = {r.request: r for r in disagg}
    by_transfer = {t.request: t for t in transfers}
    out = []
    for n in sorted(set(agg) | set(dis)):
        a, d = agg.get(n), dis.get(n)
        if a is None or d is None:
            side = "the aggregated run" if a is None else "the disaggregated run"
            raise ValueError(f"request {n} is missing from {side}: the runs cannot be compared")
        if a.error is not None:
            raise ValueError(f"request {n} failed on the aggregated worker ({a.error}): no reference to compare with")
        cause = _cause(by_transfer.get(n))
        if d.error is not None:
            out.append(Divergence(n, f"failed on the disaggregated cluster ({d.error})", cause or Cause.DECODE_OUTPUT_DIVERGED))
            continue
        if d.token_ids != a.token_ids:
            at = next((i for i, (x, y) in enumerate(zip(d.token_ids, a.token_ids)) if x != y),
                      min(len(d.token_ids), len(a.token_ids)))
            out.append(Divergence(n, f"output token ids differ from the aggregated worker's at position {at} "
                                     f"(disaggregated {list(d.token_ids)}, aggregated {list(a.token_ids)})",
                                  cause or Cause.DECODE_OUTPUT_DIVERGED))
            continue
        for field, what in (("verify_calls", "sglang:spec_verify_calls_total"), ("generation_tokens", "sglang:generation_tokens_total")):
            x, y = getattr(d, field), getattr(a, field)
            if x is None or y is None:
                side = "disaggregated decode worker" if x is None else "aggregated worker"
                raise ValueError(f"request {n}: Δ{what} missing on the {side}: speculation cannot be compared")
            if x != y:
                out.append(Divergence(n, f"same output, but Δ{what} {x:g} on decode vs {y:g} aggregated",
                                      cause or Cause.DRAFT_STATE_NOT_TRANSFERRED))
                break
    return out


def _cause(transfer: TransferRecord | None) -> Cause | None:
    """The transfer-level cause of a divergence on this request, if its surfaces show one."""
    if transfer is None:
        return None
    if transfer.transfers < 1 or transfer.bytes_moved <= 0:
        return Cause.KV_NOT_TRANSFERRED
    if transfer.checksums and not transfer.verified:
        return Cause.KV_CHECKSUM_MISMATCH
    return None
