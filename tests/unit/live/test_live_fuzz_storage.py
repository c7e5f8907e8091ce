"""``e2e fuzz --hicache --storage file``: the option, where it reaches the workers, and how the fuzz
judges a request SGLang served partly from its storage tier (kvalign/live/runs/fuzz/hicache.py,
hicache_rules.py).

The shape of a refill is the live one (tests/e2e/test_real_engine_storage.py): a prompt whose pages
left device and host, so no event held them when the router routed it (residency 0 + 0, the
router's credit 0), and SGLang's split reports them as ``storage``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvalign.cli import main
from kvalign.live.engines.hicache import STORAGE_DIR_ENV, HiCache
from kvalign.live.runs.fuzz import hicache_rules
from kvalign.live.runs.fuzz.options import FuzzOptions, engine_problem
from kvalign.live.runs.fuzz.hicache import (
    STORAGE_COUNTS, EngineTiers, TierObservation, cause, storage_pages, storage_uncredited,
)
from kvalign.live.runs.fuzz.surfaces import SurfaceMissing
from kvalign.live.runs.fuzz.tiers import Residency
from kvalign.model.causes import CACHE_BLIND, cause_class

from test_live_fuzz_hicache import judge, tobs  # type: ignore[import-not-found]
from test_live_fuzz_hicache_rules import FakeDriver  # type: ignore[import-not-found]

B = 16


def refill(engine: int, split: tuple[int, int], storage: int | None, *, residency: Residency = Residency(0, 0),
           raw: int = 0, rate: float = 0.0, n: int = 81) -> TierObservation:
    o = tobs(n, residency, raw=raw, rate=rate, engine=engine, split=split, b=B)
    o.storage = storage
    return o


def test_a_storage_refill_the_router_did_not_credit_is_storage_tier_uncredited():
    """81 EAGLE tokens (cap 4 pages of 16): all 4 refilled from storage, none in any event at the mark."""
    o = refill(64, (0, 0), 64)
    assert o.cached_expected() == 64  # the engine view: its events' 0, plus SGLang's storage 64
    assert judge(o) == ["router_credits_engine_reuse"]
    assert storage_uncredited(o) and cause(o) == "STORAGE_TIER_UNCREDITED"
    assert cause_class(cause(o)) == CACHE_BLIND  # as check --property storage classes it
    assert "+ 64 storage tokens" in o.numbers()


def test_a_device_prefix_then_a_storage_stretch_is_judged_the_same_way():
    o = refill(64, (32, 0), 32, residency=Residency(2, 0), raw=32, rate=2 / 6)
    assert judge(o) == ["router_credits_engine_reuse"] and cause(o) == "STORAGE_TIER_UNCREDITED"


def test_negative_control_the_same_shortfall_without_a_storage_refill_is_not_storage():
    """The engine reused 64 tokens its events did not hold and its split says device: no storage tier
    explains it, so the engine check fails first and the cause is not STORAGE_TIER_UNCREDITED."""
    o = refill(64, (64, 0), 0)
    assert judge(o)[0] == "engine_matches_index"
    assert not storage_uncredited(o) and cause(o) != "STORAGE_TIER_UNCREDITED"
    assert cause(refill(64, (64, 0), None)) != "STORAGE_TIER_UNCREDITED"  # no storage tier at all


def test_negative_control_a_shortfall_larger_than_the_refill_is_not_explained_by_it():
    o = refill(64, (32, 0), 16, residency=Residency(1, 0), raw=16, rate=1 / 6)
    assert judge(o)[0] == "engine_matches_index"  # 16 device tokens expected, 32 reported
    assert not storage_uncredited(o)


def test_the_storage_split_must_add_up_to_the_reported_reuse():
    tiers = EngineTiers({"worker0": "http://127.0.0.1:1/metrics"})
    assert tiers.storage("worker0", {"device": 16.0}, {"device": 48.0, "storage": 64.0}, 96) == 64
    assert tiers.storage("worker0", {"device": 16.0}, {"device": 48.0}, 32) == 0  # no refill: the split adds up
    with pytest.raises(SurfaceMissing, match="device 0 \\+ host 0 \\+ storage 0 tokens, but the worker reported "
                                             "reusing 64"):
        tiers.storage("worker0", {"device": 16.0}, {"device": 16.0, "total": 64.0}, 64)  # SGLang's no-details fallback


def test_storage_pages_round_up_to_whole_pages():
    assert [storage_pages(t, B) for t in (0, 16, 64, 65)] == [0, 1, 4, 5]


def test_the_option_reaches_sglang_as_its_own_flags():
    h = HiCache(storage="file")
    assert h.storage_args(4) == ["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
                                 json.dumps({"prefetch_threshold": 4})]
    assert h.storage_env(Path("/x/storage/worker0")) == {STORAGE_DIR_ENV: "/x/storage/worker0"}
    assert "file storage tier" in h.describe()
    # negative control: without --storage nothing of it is passed
    assert HiCache().storage_args(4) == [] and HiCache().storage_env(Path("/x")) == {}
    with pytest.raises(ValueError, match="--storage takes file"):
        HiCache(storage="mooncake")


def test_the_storage_tier_reaches_the_aggregated_workers_each_in_its_own_directory(tmp_path):
    from kvalign.live.cluster.topology import Topology
    from kvalign.live.engines.sglang_cpu import plan_cluster

    plan, kind = plan_cluster(Topology.aggregated(2, eagle=True, page_size=4), tmp_path,
                              hicache=HiCache(storage="file"))
    specs = [kind.command(w, plan) for w in plan.topology.workers]
    dirs = {spec.env[STORAGE_DIR_ENV] for spec in specs}
    assert dirs == {str(tmp_path.resolve() / "storage" / w.name) for w in plan.topology.workers}
    for spec in specs:
        i = spec.argv.index("--hicache-storage-backend")
        assert spec.argv[i + 1:i + 4] == ["file", "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 4}']
    plan, kind = plan_cluster(Topology.aggregated(2, eagle=True, page_size=4), tmp_path / "b", hicache=HiCache())
    assert not any(STORAGE_DIR_ENV in kind.command(w, plan).env for w in plan.topology.workers)


def test_the_script_keeps_the_storage_tier_and_the_engine_problem_names_where_it_runs():
    opts = FuzzOptions(hicache=HiCache(storage="file"))
    assert opts.as_json()["hicache"] == {"write_policy": "write_through", "ratio": 2.0, "storage": "file"}
    assert "storage" not in FuzzOptions(hicache=HiCache()).as_json()["hicache"]
    assert "--storage runs on --engine sglang-cpu with aggregated workers" in engine_problem(
        FuzzOptions(hicache=HiCache(storage="file"), topology="disagg"))
    assert "--storage" in engine_problem(FuzzOptions(engine="sglang-gpu", hicache=HiCache(storage="file")))


@pytest.mark.parametrize("argv, says", [
    (["e2e", "fuzz", "--storage", "file"], "--storage puts a storage tier behind SGLang's host tier: it needs --hicache"),
    (["e2e", "fuzz", "--hicache", "--storage", "nvme"], "invalid choice"),
    (["e2e", "fuzz", "--engine", "sglang-gpu", "--hicache", "--storage", "file"], "cannot run here: --storage runs on"),
    (["e2e", "fuzz", "--hicache", "--storage", "file", "--topology", "disagg"], "cannot run here: --storage runs on"),
])
def test_bad_storage_input_is_one_line_exit_2_and_starts_nothing(tmp_path, capsys, argv, says):
    assert main([*argv, "--run-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvalign: error: ") and says in err and err.count("\n") == 1, err
    assert not (tmp_path / "r").exists()


@dataclass
class FakePlan:
    run_dir: Path
    topology: object


@dataclass
class FakeCluster:
    plan: FakePlan


@dataclass
class Worker:
    name: str


@dataclass
class Topo:
    workers: list[Worker] = field(default_factory=lambda: [Worker("worker0"), Worker("worker1")])


@dataclass
class StorageDriver(FakeDriver):
    storage_refills_in_example: int = 0
    storage_refills: list = field(default_factory=list)
    cluster: FakeCluster | None = None


def test_refill_storage_pushes_the_prompt_out_of_both_tiers_then_asks_again(tmp_path):
    (tmp_path / "storage" / "worker1").mkdir(parents=True)
    (tmp_path / "storage" / "worker1" / "page.bin").write_bytes(b"x")
    gone = StorageDriver(host_forgets=True, cluster=FakeCluster(FakePlan(tmp_path, Topo())),
                         opts=FuzzOptions(page_size=4, hicache=HiCache(ratio=1.0, storage="file")))
    gone.counts.update(dict.fromkeys(STORAGE_COUNTS, 0))
    hicache_rules.refill_storage(gone, {"seed": 5, "pages": 3, "worker": 1})
    assert gone.counts["storage_evicted_requeried"] == 1 and gone.pressure() == 3
    assert gone.sent[0].tokens == gone.sent[-1].tokens and {s.pin for s in gone.sent} == {"worker1"}
    assert hicache_rules.storage_files(gone, "worker1") == 1 and hicache_rules.storage_files(gone, "worker0") == 0
    # negative control: a host tier that keeps the prompt is no storage re-query
    kept = StorageDriver(cluster=FakeCluster(FakePlan(tmp_path, Topo())),
                         opts=FuzzOptions(page_size=4, hicache=HiCache(ratio=1.0, storage="file")))
    kept.counts.update(dict.fromkeys(STORAGE_COUNTS, 0))
    hicache_rules.refill_storage(kept, {"seed": 5, "pages": 3, "worker": 0})
    assert kept.counts["storage_evicted_requeried"] == 0 and kept.pressure() == 2 * hicache_rules.max_pressure(kept)


def test_a_refilled_request_is_counted_in_pages_and_recorded():
    d = StorageDriver()
    d.counts.update(dict.fromkeys(STORAGE_COUNTS, 0))
    hicache_rules.record(d, refill(64, (0, 0), 64))
    hicache_rules.record(d, refill(32, (32, 0), 0, residency=Residency(2, 0), raw=32, rate=2 / 6))  # no refill
    assert (d.counts["storage_requeried"], d.counts["storage_refilled_pages"]) == (1, 4)
    assert d.storage_refills == [{"request": 1, "prompt_tokens": 81, "engine_device_tokens": 0, "engine_host_tokens": 0,
                                  "engine_storage_tokens": 64, "engine_tokens": 64, "router_tokens": 0,
                                  "router_tiers": (0, 0), "residency_at_routing": [0, 0]}]


def test_the_storage_rule_is_drawn_only_with_a_storage_tier():
    from hypothesis.stateful import RuleBasedStateMachine

    with_storage = hicache_rules.machine_class(RuleBasedStateMachine, StorageDriver(
        opts=FuzzOptions(page_size=4, hicache=HiCache(storage="file"))))
    without = hicache_rules.machine_class(RuleBasedStateMachine, StorageDriver())
    assert hasattr(with_storage, "refill_storage") and not hasattr(without, "refill_storage")
