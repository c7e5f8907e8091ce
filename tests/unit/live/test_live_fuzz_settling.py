"""The fuzz's waits (kvalign/live/runs/fuzz/settling.py), on a driver without a cluster.

A batch the hop loses unpublished leaves pages the worker holds and its stream never shows: the
request after it on that worker (the loss's follow-up, which extends those pages) settles on a quiet
window, since its stores' leading pages can never be accounted for (it sat out the whole bound: 8 s
of the 12.1 s live control); a loss downstream only (the engine's view still has it) changes nothing.

After an answer the driver waits for the request's own stores in the worker's stream. A batch the
hop loses unpublished (a script's control) never shows there, and it may reach the hop only after
the answer: the wait then ends on the hop's record of the loss and turns to a quiet window, instead
of sitting out ``settle_timeout_s`` (the control: without the loss the same wait runs to its bound
and is counted unsettled).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from kvalign.live.runs.fuzz.settling import Settling
from kvalign.live.wire.lossy_hop import Dropped

PROMPT = list(range(1000, 1064))  # 64 tokens: pages the request stores and the stream never shows


class Waiting(Settling):
    """The wait's inputs: a stream that shows none of the request's stores, a router side caught up."""

    def __init__(self, bound_s: float) -> None:
        self.opts = SimpleNamespace(page_size=16, settle_timeout_s=bound_s, quiet_s=0.4, hicache=None)
        self.disagg, self.unsettled, self.notes = False, 0, []
        self.hop = SimpleNamespace(dropped=[], lost_downstream={}, silenced=set())
        self._corrupted: set[str] = set()
        self.engine_views = SimpleNamespace(epoch={}, since_epoch=lambda label: [])
        self.quiet_waits: list[bool] = []

    def engine_eagle(self, label: str) -> bool:
        return True

    def _held(self, views: object, label: str, cached: list[int], mark: int, salt: str | None = None) -> tuple[int]:
        return (0,)

    def _behind(self) -> dict[str, int]:
        return {"worker0": 0}

    def _applied_behind(self) -> float:
        return 0.0

    def _settle(self, *, after_request: bool = False) -> bool:
        self.quiet_waits.append(after_request)
        return True

    def progress(self, message: str) -> None:
        pass


def _wait(driver: Waiting, *, lost_after_s: float | None) -> tuple[bool, float]:
    if lost_after_s is not None:  # the hop swallows the request's store batch after the answer came back
        threading.Timer(lost_after_s, lambda: driver.hop.dropped.append(
            Dropped("worker0", 7, 4, time.monotonic(), "store", unpublished=True))).start()
    start = time.monotonic()
    settled = driver._settle_stores("worker0", PROMPT, [5, 6], 0, None, start, len(driver.hop.dropped))
    return settled, time.monotonic() - start


def test_a_batch_lost_unpublished_after_the_answer_ends_the_wait_on_its_record_with_a_quiet_window():
    driver = Waiting(bound_s=5.0)
    settled, took = _wait(driver, lost_after_s=0.1)
    assert settled and driver.quiet_waits == [True] and driver.unsettled == 0
    assert took < 2.0, f"the wait sat out {took:.1f}s of its 5s bound for stores that could not come"


def test_the_control_without_the_loss_the_wait_runs_to_its_bound_and_is_counted_unsettled():
    driver = Waiting(bound_s=0.3)
    settled, took = _wait(driver, lost_after_s=None)
    assert not settled and driver.unsettled == 1 and driver.quiet_waits == [] and took >= 0.3


def test_a_batch_lost_downstream_only_still_waits_for_the_stores():
    """The engine's view keeps a batch the hop lost downstream only: its stores are still waited on."""
    driver = Waiting(bound_s=0.3)
    driver.hop.dropped.append(Dropped("worker0", 7, 4, time.monotonic(), "store", unpublished=False))
    settled = driver._settle_stores("worker0", PROMPT, [5, 6], 0, None, time.monotonic(), 0)
    assert not settled and driver.unsettled == 1 and driver.quiet_waits == []


def test_after_a_batch_lost_unpublished_the_workers_next_request_settles_on_quiet_not_its_stores():
    driver = Waiting(bound_s=5.0)
    assert driver._awaits_stores("worker0", 0)
    driver.hop.dropped.append(Dropped("worker0", 7, 4, time.monotonic(), "store", unpublished=True))
    driver._broken_by_losses(0)  # the lost request
    follow_up = len(driver.hop.dropped)
    assert not driver._awaits_stores("worker0", follow_up), "the follow-up would wait out the bound"
    assert driver._awaits_stores("worker1", follow_up)  # another worker's stream is whole


def test_the_control_a_batch_lost_downstream_only_leaves_the_worker_settled_on_its_stores():
    driver = Waiting(bound_s=5.0)
    driver.hop.dropped.append(Dropped("worker0", 7, 4, time.monotonic(), "store", unpublished=False))
    driver._broken_by_losses(0)
    assert driver._awaits_stores("worker0", len(driver.hop.dropped))
