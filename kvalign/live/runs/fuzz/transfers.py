"""``kv_transferred``: on a disaggregated cluster, each request sent alone handed its KV to decode
over the transfer backend, and SGLang's checksum verified it there.

The fuzz's own reading of the decode half (:mod:`kvalign.live.runs.disagg_invisible` judges it):
around each alone-sent request, the prefill workers' ``sglang:kv_transfer_total_mb`` histogram must
gain an observation with bytes, and (with a real backend, which runs SGLang's checksum) every
verification decode recorded during the request must have matched. A request sent in a burst is
not judged (its siblings' transfers share the deltas), nor one dropped on purpose. The baseline is
taken right before each request, so a restarted prefill (its histogram back at zero) never reads as
a negative transfer.
"""

from __future__ import annotations

from kvalign.live.runs.decode_half import TransferProbe
from kvalign.live.runs.disagg_invisible import TransferRecord, transfer_failures
from kvalign.live.runs.fuzz.invariants import InvariantFailed, Tally

INVARIANT = "kv_transferred"


class FuzzTransfers:
    """The ``kv_transferred`` check of one disaggregated fuzz run."""

    def __init__(self, probe: TransferProbe, tally: Tally) -> None:
        self.probe, self.tally = probe, tally
        self.moved: list[TransferRecord] = []

    @property
    def checksum(self) -> bool:
        """SGLang's checksum runs on both sides: every backend but ``fake`` (which sends no digest)."""
        return self.probe.backend != "fake"

    def before(self) -> None:
        self.probe.start()

    def after(self, request: int) -> TransferRecord:
        """Judge request ``request``'s hand-off; raises :class:`InvariantFailed` naming the cause."""
        rec = self.probe.record(request, wait_s=0.0 if self.probe.backend == "fake" else WAIT_S)
        self.moved.append(rec)
        self.tally.checked[INVARIANT] += 1
        failures = transfer_failures([rec], checksum=self.checksum)
        if failures:
            self.tally.failed[INVARIANT] += 1
            f = failures[0]
            raise InvariantFailed(INVARIANT, f.what, cause=f.cause.name, request=request,
                                  numbers={"transfers": rec.transfers, "bytes_moved": rec.bytes_moved,
                                           "checksum_verifications": list(rec.checksums)})
        return rec

    def as_json(self) -> dict[str, object]:
        """What moved over the run: the backend, per-request bytes, latencies and verifications."""
        return {"backend": self.probe.backend, "requests": len(self.moved),
                "bytes_moved": sum(r.bytes_moved for r in self.moved),
                "checksum_verified": sum(r.verified for r in self.moved),
                "latency_ms_max": max((r.latency_ms for r in self.moved if r.latency_ms is not None), default=None)}


#: How long a judged request's transfer may take to show on prefill's histogram: SGLang observes it
#: when its prefill loop next polls the finished transfer, which can come after decode answered.
WAIT_S = 3.0
