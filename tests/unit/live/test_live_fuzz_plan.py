"""The fuzz's cluster plan (kvalign/live/runs/fuzz/plan.py): every option read in one place, offline.

``plan_fuzz`` builds the tiny models and allocates ports but starts nothing, so what the workers,
the hop and the routers will be told is held here without a cluster.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvalign.live.cluster import ranks
from kvalign.live.engines.sglang_worker import RELAY_SUBSCRIBE_ENV, SERVER_INFO_ENV
from kvalign.live.runs.fuzz.options import FuzzOptions
from kvalign.live.runs.fuzz.plan import DECODE_POOL_TOKENS, plan_fuzz
from kvalign.standins import sglang_cpu as sglang_cpu_standin


def arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_each_publishing_worker_gets_its_own_hop_and_every_option_reaches_the_workers(tmp_path):
    plan = plan_fuzz(FuzzOptions(workers=2, max_total_tokens=384, routers=2, event_format="dynamo",
                                 publisher_faults=True), tmp_path)
    assert plan.labels == ["worker0", "worker1"]
    assert plan.upstream == ranks.endpoints(plan.cluster)
    hop_ports = [*plan.downstream.values(), *plan.taps.values()]
    assert len(set(hop_ports)) == 4 and not set(hop_ports) & set(plan.cluster.all_ports())
    assert plan.cluster.routers.count == 2 and len(plan.cluster.router_http_ports) == 1
    assert plan.silenced == frozenset()
    for w in plan.cluster.topology.workers:
        spec = plan.kind.command(w, plan.cluster)
        assert spec.env[RELAY_SUBSCRIBE_ENV] == f"tcp://127.0.0.1:{plan.downstream[w.name]}"
        assert arg(spec.argv, "--max-total-tokens") == "384"
        assert json.loads(arg(spec.argv, "--kv-events-config"))["format"] == "dynamo"
        assert SERVER_INFO_ENV in spec.env
        assert spec.env[sglang_cpu_standin.PUBLISHER_FAULTS_ENV] == str(tmp_path / "publisher-faults" / f"{w.name}.json")


def test_disaggregation_hops_only_the_prefill_workers_and_gives_decode_its_own_pool(tmp_path):
    plan = plan_fuzz(FuzzOptions(topology="disagg", workers=2), tmp_path)
    assert plan.labels == ["prefill0", "prefill1"]
    decode = next(w for w in plan.cluster.topology.workers if w.role == "decode")
    spec = plan.kind.command(decode, plan.cluster)
    assert arg(spec.argv, "--max-total-tokens") == str(DECODE_POOL_TOKENS)
    assert RELAY_SUBSCRIBE_ENV not in spec.env and sglang_cpu_standin.PUBLISHER_FAULTS_ENV not in spec.env


def test_only_rank0_publishes_silences_every_other_rank_at_the_hop(tmp_path):
    opts = FuzzOptions(workers=1, dp_size=2)
    assert plan_fuzz(opts, tmp_path / "a").silenced == frozenset()
    plan = plan_fuzz(dataclasses.replace(opts, rank0_only=True), tmp_path / "b")
    assert plan.labels == ["worker0.dp0", "worker0.dp1"] and plan.silenced == {"worker0.dp1"}


def test_the_plan_is_read_only(tmp_path):
    plan = plan_fuzz(FuzzOptions(), tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.kind = None  # type: ignore[misc]
