"""What the fuzz driver reports (kvalign/live/runs/fuzz/driver.py), on a driver without a cluster.

The driver's checks and counts read kvalign's own views of captured streams; here the captures are
stand-ins that hold streams built as SGLang publishes them (tests/unit/streams/test_engine_reuse.py
holds the same streams against the analysis itself), so the driver's reporting is held offline:

* a failure whose engine reused pages its own stream never stored in the prompt's chain is named
  ``ENGINE_EVENTS_MISSING`` (with the pages, from the stream recorded for it), never ``none``;
* ``lost_requeried`` counts a follow-up only when its engine view shows the lost pages reused.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvalign.live.runs.fuzz.driver import COUNTS, FuzzDriver
from kvalign.live.runs.fuzz.options import FuzzOptions
from kvalign.live.runs.fuzz.invariants import InvariantFailed, Observation, Tally
from kvalign.live.runs.fuzz.prompts import Sent
from kvalign.live.runs.fuzz.views import DeliveredViews, WorkerViews
from kvalign.live.wire.capture import Captured
from kvalign.live.wire.client import Completion
from kvalign.live.wire.lossy_hop import Dropped
from kvalign.model.events import AllBlocksCleared, BlockStored, EventBatch, KVEvent
from kvalign.model.sglang_keys import engine_block_hashes, page_count, page_units
from kvalign.streams.diagnose import RouterSettings, diagnose

B = 16
A = list(range(1000, 1050))  # 50 tokens: 3 bigram pages
AB = [*A, *range(2000, 2020)]  # 70 tokens: 4 pages


def store(tokens: list[int], cached: int, parent: int | None = None) -> BlockStored:
    hashes = engine_block_hashes(tokens, B, eagle=True)
    n = page_count(len(tokens), B, eagle=True)
    return BlockStored(hashes[cached:n], parent if parent is not None else (hashes[cached - 1] if cached else None),
                       [u for page in page_units(tokens, B, eagle=True)[cached:n] for u in page], B)


class Capture:
    """The part of :class:`~kvalign.live.wire.capture.EventCapture` the views read."""

    def __init__(self, batches: list[KVEvent], path: str | None = None) -> None:
        self.endpoints = {"worker0": "tcp://127.0.0.1:1", "worker1": "tcp://127.0.0.1:2"}
        self.batches = [Captured("worker0", EventBatch(float(i), [ev], 0, "map", i), float(i)) for i, ev in enumerate(batches)]
        self.path = path

    def snapshot(self) -> list[Captured]:
        return list(self.batches)

    def count(self, label: str | None = None) -> int:
        return sum(1 for c in self.batches if label is None or c.label == label)

    def capture_path(self, label: str) -> str | None:
        return self.path


def driver(tmp_path: Path, engine: list[KVEvent], router: list[KVEvent] | None = None,
           router_path: str | None = None) -> FuzzDriver:
    d = object.__new__(FuzzDriver)
    d.opts, d.tally, d.counts, d.notes, d.progress = FuzzOptions(), Tally(), dict.fromkeys(COUNTS, 0), [], lambda _m: None
    eng, rout = Capture(engine), Capture(engine if router is None else router, router_path)
    d.cluster = SimpleNamespace(capture=eng, router_capture=rout, plan=SimpleNamespace(run_dir=tmp_path),
                                workers={"worker0": SimpleNamespace(enable_eagle=True)})
    d.hop = SimpleNamespace(dropped=[], original_seq=lambda _label, seq: seq)
    d.engine_views, d.router_views = WorkerViews(eng, B), WorkerViews(rout, B)
    d.delivered_views = DeliveredViews(d.engine_views, d.router_views)
    return d


def observation(tokens: list[int], *, reused: int, held: int, router_blocks: int, mark: int, request: int = 3,
                stored: int = 0) -> Observation:
    n = len(tokens)
    c = Completion(n, reused, [1], 7, 7, router_blocks / -(-n // B))
    obs = Observation(request, tokens, c, "worker0", False, B, True, router_blocks, held, reused)
    obs.stored_pages, obs.engine_mark = stored, mark
    return obs


def test_a_store_the_engines_publisher_dropped_is_named_from_the_recorded_stream(tmp_path: Path) -> None:
    """AB's store never published: AB again reuses 4 pages, the engine's stream holds 3. The failure
    names the engine's events with page 3, recorded beside it with the offline replay command;
    reading only the router side (the old reporting) finds nothing to name."""
    d = driver(tmp_path, [AllBlocksCleared(), store(A, 0)])  # the example's flush, then A
    d.engine_views.epoch["worker0"] = d.router_views.epoch["worker0"] = 1
    obs = observation(AB, reused=64, held=3, router_blocks=3, mark=2)
    with pytest.raises(InvariantFailed) as err:
        d._check(obs)
    f = err.value
    assert f.invariant == "engine_matches_index" and f.cause == "ENGINE_EVENTS_MISSING"
    assert f.failing == ["engine_matches_index", "router_credits_engine_reuse"] and f.evidence["kind"] == "never_stored"
    assert f.evidence["pages"] == [3, 3] and "page 3 (tokens [48, 64))" in f.evidence["detail"]
    recorded = Path(f.evidence["capture"])
    assert recorded.parent == tmp_path / "failures" / "request-3" and json.loads(Path(f.evidence["prompt"]).read_text()) == AB
    assert f.evidence["replay"].startswith(f"kvalign diagnose --capture {recorded} ") and "--engine-reused 64" in f.evidence["replay"]
    # the offline replay of the recorded stream names the same cause
    d2 = diagnose(str(recorded), AB, RouterSettings(block_size=B), engine_reused=64, routed_at=f.evidence["routed_at_batch"])
    assert d2.cause is not None and d2.cause.name == "ENGINE_EVENTS_MISSING"
    assert f.evidence["routed_at_batch"] == 2 and not d2.notes  # recorded from the flush: no "joined late" note


def test_a_wrong_parent_in_the_engines_stream_is_named_not_a_prompt_shift(tmp_path: Path) -> None:
    d = driver(tmp_path, [store(A, 0), store(AB, 3, parent=12345)])
    with pytest.raises(InvariantFailed) as err:
        d._check(observation(AB, reused=64, held=3, router_blocks=3, mark=2))
    assert err.value.cause == "ENGINE_EVENTS_MISSING" and err.value.evidence["kind"] == "outside_chain"
    assert "wrong parent" in err.value.evidence["detail"]


def test_stores_published_after_the_request_was_routed_are_named_late(tmp_path: Path) -> None:
    """The timing case: when the request was routed the stream had only A; AB's store came after.
    The recorded stream names it (a live replay of the steps may well pass)."""
    d = driver(tmp_path, [store(A, 0), store(AB, 3)])
    with pytest.raises(InvariantFailed) as err:
        d._check(observation(AB, reused=64, held=3, router_blocks=3, mark=1))
    assert err.value.cause == "ENGINE_EVENTS_LATE" and err.value.evidence["seq"] == 1


def test_a_failure_the_engines_stream_explains_still_goes_to_diagnose(tmp_path: Path) -> None:
    """The router credited nothing for pages the engine's stream holds: not the engine's events."""
    d = driver(tmp_path, [store(A, 0), store(AB, 3)])
    with pytest.raises(InvariantFailed) as err:
        d._check(observation(AB, reused=64, held=4, router_blocks=0, mark=2))
    assert err.value.failing == ["router_credits_engine_reuse"]
    assert err.value.cause == "none" and err.value.evidence is None  # no router capture here to diagnose


# ---- lost_requeried -----------------------------------------------------------------------------


class DropDriver:
    """``_drop`` with the hop losing the request's batch and the two requests answered as given."""

    def __init__(self, tmp_path: Path, first: Observation, follow_up: Observation) -> None:
        self.d = d = driver(tmp_path, [])
        answers = iter([first, follow_up])

        def request(tokens: list[int], max_tokens: int, pin: str | None = None, **_: Any) -> Observation:
            obs = next(answers)
            d.history.append(Sent(tuple(tokens), (9, 9)))
            if obs is first:
                d.hop.dropped.append(Dropped("worker0", 5, 3, 0.0))
            return obs

        d._request, d.history = request, []
        d.hop.drop_next_store_batch = lambda unpublished=False: None
        d.hop.disarm = lambda: True
        d.diagnose = lambda label, tokens: SimpleNamespace(cause=SimpleNamespace(name="SEQUENCE_GAP"), detail="")

    def run(self) -> dict[str, int]:
        self.d._drop(A, 2)
        return self.d.counts


def test_lost_requeried_counts_a_follow_up_that_reused_the_lost_pages(tmp_path: Path) -> None:
    first = observation(A, reused=0, held=0, router_blocks=0, mark=0, stored=3)
    again = observation(AB, reused=48, held=3, router_blocks=0, mark=1, request=4)
    counts = DropDriver(tmp_path, first, again).run()
    assert counts["lost_requeried"] == 1 and counts["dropped_batches"] == 1 and counts["lost_batches_diagnosed"] == 1


@pytest.mark.parametrize("held, reused", [(0, 0), (3, 16), (1, 48)], ids=["evicted", "reused-fewer", "view-lost-them"])
def test_lost_requeried_does_not_count_a_follow_up_that_did_not_reuse_them(tmp_path: Path, held: int, reused: int) -> None:
    first = observation(A, reused=0, held=0, router_blocks=0, mark=0, stored=3)
    again = observation(AB, reused=reused, held=held, router_blocks=0, mark=1, request=4)
    counts = DropDriver(tmp_path, first, again).run()
    assert counts["lost_requeried"] == 0 and counts["dropped_batches"] == 1


@pytest.mark.parametrize("setting, named", [("0", "VLLM_BYTES_HASHES_DROPPED"), ("1", "ENGINE_EVENTS_MISSING")])
def test_a_vllm_worker_on_bytes_hashes_is_named_from_its_environment_and_stream(tmp_path: Path, setting: str,
                                                                                named: str) -> None:
    """vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: its store batch is kept undecoded by kvalign's real capture
    writer (hashes decoded as Dynamo's relay decodes them), so both views are empty; vLLM reused 48 tokens, the
    router credited 0. The failure is the router's credit, named VLLM_BYTES_HASHES_DROPPED from the worker's
    environment and the bytes-hash store. The control: the same stream and answer from a worker whose environment
    says int hashes is not that cause (the empty stream names the engine's events instead)."""
    import msgspec

    from kvalign.streams.capture import CaptureWriter

    path = str(tmp_path / "worker0.capture.jsonl")
    writer = CaptureWriter(path, force=True)
    stored = {"type": "BlockStored", "block_hashes": [bytes([i]) * 32 for i in range(3)], "parent_block_hash": None,
              "token_ids": AB[:48], "block_size": B, "lora_id": None, "medium": "GPU", "lora_name": None}
    assert writer.write_frames([b"", (0).to_bytes(8, "big"), msgspec.msgpack.encode([0.0, [stored], 0])])
    writer.close()
    d = driver(tmp_path, [])
    d.opts = FuzzOptions(engine="vllm-cpu", page_size=B)
    d.cluster.capture.path = path
    d.cluster.group = SimpleNamespace(environ=lambda name: {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": setting}
                                      if name == "worker0" else None)
    obs = observation(AB, reused=48, held=0, router_blocks=0, mark=0)
    obs.engine_eagle, obs.vllm = False, True
    with pytest.raises(InvariantFailed) as err:
        d._check(obs)
    f = err.value
    assert f.cause == named and f.failing == ["engine_matches_index", "router_credits_engine_reuse"]
    if named == "VLLM_BYTES_HASHES_DROPPED":
        assert f.invariant == "router_credits_engine_reuse" and f.evidence["bytes_hash_stores"]["blocks"] == 3
    else:
        assert f.invariant == "engine_matches_index"
