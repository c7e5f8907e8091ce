"""The decode half's recorder (kvalign/live/runs/decode_half.py) on served /metrics pages and ledgers:
per-request deltas of SGLang's transfer histograms, the checksum verifications of each request, and
an answer whose token ids are missing or short is an error naming it."""

from __future__ import annotations

import json

import pytest

from kvalign.live.runs import decode_half
from kvalign.live.runs.scenario import RequestRecord
from kvalign.live.wire.client import ChatResult
from kvalign.live.wire.metrics import parse_metrics


def _page(count: int, mb: float, ms: float) -> str:
    """SGLang's two transfer histograms as a prefill worker exports them (only once observed)."""
    if not count:
        return "# HELP sglang:num_requests_total x\n# TYPE sglang:num_requests_total counter\nsglang:num_requests_total 1\n"
    lines = []
    for name, total in (("sglang:kv_transfer_total_mb", mb), ("sglang:kv_transfer_latency_ms", ms)):
        lines += [f"# HELP {name} x", f"# TYPE {name} histogram", f'{name}_bucket{{le="+Inf"}} {count}',
                  f"{name}_count {count}", f"{name}_sum {total}"]
    return "\n".join(lines) + "\n"


def test_each_request_gets_its_own_transfer_and_verifications(metrics_page, tmp_path):
    url, served = metrics_page
    ledger = tmp_path / "decode0.checksums.jsonl"
    ledger.write_text(json.dumps({"rid": "warm-up", "tokens": 4, "verified": True}) + "\n")
    served["text"] = _page(1, 0.01, 5.0)  # the harness's readiness request, before the probe starts
    probe = decode_half.TransferProbe([url], [ledger], "nixl")
    probe.start()
    served["text"] = _page(2, 0.01 + 20480 / 2**20, 27.5)
    with ledger.open("a") as out:
        out.write(json.dumps({"rid": "r1", "tokens": 21, "verified": True}) + "\n")
    first = probe.record(1)
    assert (first.transfers, first.bytes_moved, first.latency_ms, first.checksums, first.checksum_tokens) == \
        (1, 20480, 22.5, (True,), 21)
    assert first.verified and first.exported
    second = probe.record(2)  # nothing moved, nothing verified since
    assert (second.transfers, second.bytes_moved, second.latency_ms, second.checksums) == (0, 0, None, ())


def test_a_prefill_that_never_transferred_exports_no_family(metrics_page, tmp_path):
    """SGLang's ``fake`` backend: the histogram never appears; recorded as such, not as a zero reading."""
    url, served = metrics_page
    served["text"] = _page(0, 0, 0)
    probe = decode_half.TransferProbe([url], [tmp_path / "absent.jsonl"], "fake")
    probe.start()
    rec = probe.record(1)
    assert (rec.transfers, rec.exported, rec.checksums) == (0, False, ())


def _record(ids: list[int] | None, completion: int | None) -> RequestRecord:
    usage = {} if completion is None else {"completion_tokens": completion}
    return RequestRecord(0, [1, 2, 3], True, {}, ChatResult(token_ids=ids, usage=usage))


def test_an_answer_without_its_token_ids_is_an_error_naming_the_field():
    before, after = parse_metrics("sglang:spec_verify_calls_total 1\n"), parse_metrics("sglang:spec_verify_calls_total 6\n")
    rec = decode_half.decode_record(_record([5, 6, 7], 3), before, after)
    assert (rec.request, rec.token_ids, rec.verify_calls, rec.generation_tokens) == (1, (5, 6, 7), 5.0, 0.0)
    with pytest.raises(ValueError, match="carried no nvext.completion_token_ids"):
        decode_half.decode_record(_record(None, 3), before, after)
    with pytest.raises(ValueError, match="2 nvext.completion_token_ids for usage.completion_tokens 3"):
        decode_half.decode_record(_record([5, 6], 3), before, after)
    assert decode_half.decode_record(_record(None, None), before, after, error="HTTP 500").error == "HTTP 500"
