"""``kv_transferred`` (kvalign/live/runs/fuzz/transfers.py) on served prefill /metrics pages and a decode
ledger: a request whose KV moved and verified passes; the ``fake`` backend's request and a failed
checksum fail naming their causes; a transfer prefill observes late is waited for, boundedly."""

from __future__ import annotations

import json
import threading
import time

import pytest

from kvalign.live.runs.decode_half import TransferProbe
from kvalign.live.runs.fuzz.invariants import InvariantFailed, Tally
from kvalign.live.runs.fuzz.transfers import INVARIANT, FuzzTransfers
from kvalign.model.causes import Cause


def _page(count: int, mb: float) -> str:
    if not count:
        return "# HELP sglang:num_requests_total x\n# TYPE sglang:num_requests_total counter\nsglang:num_requests_total 1\n"
    name = "sglang:kv_transfer_total_mb"
    return (f"# HELP {name} x\n# TYPE {name} histogram\n{name}_bucket{{le=\"+Inf\"}} {count}\n"
            f"{name}_count {count}\n{name}_sum {mb}\n")


def _verify(ledger, ok: bool) -> None:
    with ledger.open("a") as out:
        out.write(json.dumps({"rid": "r", "tokens": 33, "verified": ok}) + "\n")


@pytest.fixture
def check(metrics_page, tmp_path):
    url, served = metrics_page
    ledger = tmp_path / "decode0.checksums.jsonl"

    def make(backend: str) -> tuple[FuzzTransfers, dict, object]:
        served["text"] = _page(1, 0.01)
        return FuzzTransfers(TransferProbe([url], [ledger], backend), Tally()), served, ledger

    return make


def test_a_moved_and_verified_request_passes_and_is_counted(check):
    transfers, served, ledger = check("nixl")
    transfers.before()
    served["text"] = _page(2, 0.05)
    _verify(ledger, True)
    rec = transfers.after(7)
    assert rec.transfers == 1 and rec.bytes_moved > 0 and rec.checksums == (True,)
    assert (transfers.tally.checked[INVARIANT], transfers.tally.failed[INVARIANT]) == (1, 0)
    assert transfers.as_json()["checksum_verified"] == 1


def test_the_fake_backend_fails_naming_decode_without_kv(check):
    transfers, _served, _ledger = check("fake")
    transfers.before()
    with pytest.raises(InvariantFailed) as exc:
        transfers.after(3)
    assert exc.value.invariant == INVARIANT and exc.value.cause == Cause.KV_NOT_TRANSFERRED.name
    assert exc.value.request == 3 and transfers.tally.failed[INVARIANT] == 1


def test_a_failed_checksum_fails_naming_it(check):
    transfers, served, ledger = check("nixl")
    transfers.before()
    served["text"] = _page(2, 0.05)
    _verify(ledger, False)
    with pytest.raises(InvariantFailed) as exc:
        transfers.after(4)
    assert exc.value.cause == Cause.KV_CHECKSUM_MISMATCH.name


def test_a_transfer_prefill_observes_late_is_waited_for(check):
    """SGLang observes the histogram when its prefill loop next polls the finished transfer."""
    transfers, served, ledger = check("nixl")
    transfers.before()
    _verify(ledger, True)
    threading.Timer(0.3, lambda: served.__setitem__("text", _page(2, 0.05))).start()
    t0 = time.monotonic()
    assert transfers.after(1).transfers == 1
    assert time.monotonic() - t0 < 2.5
