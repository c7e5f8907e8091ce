"""Data-parallel real-engine workers (``--dp-size N``): their ports, command, relay hops and sources.

The workers themselves run in tests/e2e/test_fuzz_dp.py; here: what a data-parallel worker is
started with, that every rank has its own KV-event port and hop, and that nothing changes for a
worker with one rank.
"""

from __future__ import annotations

import json

import pytest

from kvalign.live.cluster import ranks
from kvalign.live.cluster.lifecycle import make_plan
from kvalign.live.cluster.ports import PortPool, is_free
from kvalign.live.cluster.topology import Topology
from kvalign.live.engines.dp_workers import dp_problem, threads_bind
from kvalign.live.engines.sglang_cpu import SglangCpuWorkerKind
from kvalign.live.engines.sglang_worker import RELAY_SUBSCRIBE_ENV
from kvalign.live.runs.fuzz.dp_ranks import relay_subscriptions


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_a_port_range_is_consecutive_free_and_kept_from_other_names():
    pool = PortPool(seed=3)
    base = pool.take_range("w0.kv_events", 4)
    assert all(is_free(p) for p in range(base, base + 4))
    assert pool.take_range("w0.kv_events", 4) == base  # stable per name
    others = {pool.take(f"x{i}") for i in range(200)}
    assert not others & set(range(base, base + 4))


def test_a_data_parallel_worker_has_one_kv_event_port_per_rank(tmp_path):
    plan = make_plan(Topology.aggregated(1, eagle=True, dp_size=2), tmp_path)
    (w,) = plan.topology.workers
    ports = plan.worker_ports[w.name]
    assert ports.kv_ranks == 2
    assert [plan.kv_events_connect(w, r) for r in range(2)] == [
        f"tcp://127.0.0.1:{ports.kv_events}", f"tcp://127.0.0.1:{ports.kv_events + 1}"]
    assert ports.kv_events + 1 in plan.all_ports()  # the hops keep clear of rank 1's port too
    with pytest.raises(ValueError, match="not rank 2"):
        plan.kv_events_connect(w, 2)
    assert ranks.endpoints(plan) == {"worker0.dp0": plan.kv_events_connect(w, 0), "worker0.dp1": plan.kv_events_connect(w, 1)}


def test_without_dp_size_the_sources_are_the_workers(tmp_path):
    plan = make_plan(Topology.aggregated(2, eagle=True), tmp_path)
    assert list(ranks.sources(plan)) == ["worker0", "worker1"]
    assert ranks.split_label("worker1") == ("worker1", None)
    assert ranks.split_label("worker1.dp3") == ("worker1", 3)


def test_dp_size_is_for_aggregated_workers():
    with pytest.raises(ValueError, match="aggregated"):
        Topology(Topology.disaggregated(1, 1, eagle=True).workers, 16, 2)
    with pytest.raises(ValueError, match=">= 1"):
        Topology.aggregated(1, eagle=True, dp_size=0)


def test_the_worker_command_asks_sglang_for_the_ranks_and_binds_each_ranks_cores(tmp_path):
    plan = make_plan(Topology.aggregated(1, eagle=True, dp_size=2), tmp_path)
    spec = SglangCpuWorkerKind("/draft").command(plan.topology.workers[0], plan)
    assert _flag(spec.argv, "--dp-size") == "2"
    # one fixed --nccl-port is taken by every DP rank's torch.distributed group (EADDRINUSE, seen live)
    assert "--nccl-port" not in spec.argv
    assert len(spec.env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2
    config = json.loads(_flag(spec.argv, "--kv-events-config"))
    assert config["endpoint"] == plan.kv_events_connect(plan.topology.workers[0]) and config["bind"] is True


def test_one_rank_workers_are_started_as_before(tmp_path):
    plan = make_plan(Topology.aggregated(2, eagle=True), tmp_path)
    spec = SglangCpuWorkerKind("/draft").command(plan.topology.workers[0], plan)
    assert "--dp-size" not in spec.argv and "SGLANG_CPU_OMP_THREADS_BIND" not in spec.env
    assert _flag(spec.argv, "--nccl-port") == str(plan.worker_ports["worker0"].nccl)


@pytest.mark.parametrize("dp, cpus, bind", [
    (2, [0, 1], "0|1"), (2, [0, 1, 2, 3], "0-1|2-3"), (4, [0, 1], "0|1|0|1"), (3, [0, 1, 2, 3, 4, 5, 6], "0-1|2-3|4-5"),
])
def test_threads_bind_gives_each_rank_its_share(dp, cpus, bind):
    assert threads_bind(dp, cpus) == bind


def test_only_the_release_with_bind_and_per_rank_ports_runs_data_parallel():
    assert dp_problem("0.5.23", 2) is None and dp_problem("0.5.21", 1) is None
    assert "0.5.23" in dp_problem("0.5.21", 2)


def test_every_rank_gets_its_own_hop_in_the_relay(tmp_path):
    plan = make_plan(Topology.aggregated(1, eagle=True, dp_size=2), tmp_path)
    w = plan.topology.workers[0]
    subs = relay_subscriptions(plan, {"worker0.dp0": 30001, "worker0.dp1": 30002})
    assert json.loads(subs["worker0"]) == {plan.kv_events_connect(w, 0): "tcp://127.0.0.1:30001",
                                           plan.kv_events_connect(w, 1): "tcp://127.0.0.1:30002"}
    spec = SglangCpuWorkerKind("/draft", relay_subscribe=subs).command(w, plan)
    assert spec.argv[1:3] == ["-m", "kvalign.live.engines.sglang_worker"] and spec.env[RELAY_SUBSCRIBE_ENV] == subs["worker0"]
    one = make_plan(Topology.aggregated(2, eagle=True), tmp_path / "one")
    assert relay_subscriptions(one, {"worker0": 30001, "worker1": 30002}) == {
        "worker0": "tcp://127.0.0.1:30001", "worker1": "tcp://127.0.0.1:30002"}


def test_relay_via_a_map_sends_each_rank_to_its_hop_and_refuses_an_unknown_one():
    from kvalign.live.engines.sglang_worker import subscribe_via

    own = lambda template, ip: template.replace("*", ip)  # noqa: E731 - format_zmq_endpoint's job
    via = subscribe_via(own, json.dumps({"tcp://127.0.0.1:5557": "tcp://127.0.0.1:6001",
                                         "tcp://127.0.0.1:5558": "tcp://127.0.0.1:6002"}))
    assert via("tcp://*:5558", "127.0.0.1") == "tcp://127.0.0.1:6002"
    assert via("tcp://*:5557", "127.0.0.1") == "tcp://127.0.0.1:6001"
    with pytest.raises(SystemExit, match="no hop serves"):
        via("tcp://*:5559", "127.0.0.1")
    assert subscribe_via(own, "tcp://127.0.0.1:6001")("tcp://*:5557", "127.0.0.1") == "tcp://127.0.0.1:6001"


def test_live_up_dp_size_needs_the_real_engine_and_aggregated_workers(capsys):
    from kvalign.cli import main

    for argv, message in ((["live", "plan", "--dp-size", "2"], "--dp-size needs --engine sglang-cpu"),
                          (["live", "plan", "--engine", "sglang-cpu", "--prefill", "1", "--dp-size", "2"], "aggregated"),
                          (["live", "plan", "--engine", "sglang-cpu", "--dp-size", "0"], "--dp-size must be >= 1")):
        assert main(argv) == 2
        assert message in capsys.readouterr().err


def test_dp_attention_ranks_are_groups_of_one_tp_group_sharing_its_nccl_port(tmp_path):
    plan = make_plan(Topology.aggregated(1, eagle=True, dp_size=2, dp_attention=True), tmp_path)
    spec = SglangCpuWorkerKind("/draft").command(plan.topology.workers[0], plan)
    assert (_flag(spec.argv, "--tp-size"), _flag(spec.argv, "--attn-dp-size")) == ("2", "2")
    assert "--dp-size" not in spec.argv
    # one TP group: SGLang gives every DP-attention rank the group's own port, so ours is safe to pin
    assert _flag(spec.argv, "--nccl-port") == str(plan.worker_ports["worker0"].nccl)
    assert plan.worker_ports["worker0"].kv_ranks == 2
    with pytest.raises(ValueError, match="--dp-size 2 or more"):
        Topology.aggregated(1, eagle=True, dp_attention=True)
