"""The shared launch plan: topology, loopback-only environment, and the CPU worker command."""

from __future__ import annotations

import json

import pytest

from kvalign.live.engines import fake_cpu_worker as cpu_worker
from kvalign.live.cluster.lifecycle import make_plan, plan_specs
from kvalign.live.cluster.topology import RUN_MARKER_ENV, CpuWorkerKind, Topology


@pytest.fixture
def disagg_plan(tmp_path):
    return make_plan(Topology.disaggregated(2, 1, eagle=True), tmp_path)


def test_topologies_roles_components_and_event_sources():
    agg = Topology.aggregated(2, eagle=False)
    assert [w.role for w in agg.workers] == ["agg", "agg"] and not agg.disaggregated_mode
    dis = Topology.disaggregated(2, 1, eagle=True, register_eagle=False)
    assert [(w.name, w.component, w.publishes_kv_events) for w in dis.workers] == [
        ("prefill0", "prefill", True), ("prefill1", "prefill", True), ("decode0", "backend", False)]
    assert all(w.eagle and w.register_eagle is False for w in dis.workers)


def test_plan_ports_are_distinct_and_env_is_loopback_only(disagg_plan):
    plan = disagg_plan
    ports = [plan.http_port, plan.broker_xsub, plan.broker_xpub]
    for wp in plan.worker_ports.values():
        ports += wp.all()
    assert len(set(ports)) == len(ports) == 3 + 5 * 3
    env = plan.plane_env()
    for key in ("DYN_TCP_RPC_HOST", "DYN_TCP_RESPONSE_STREAM_HOST", "DYN_EVENT_PLANE_HOST", "DYN_SYSTEM_HOST",
                "SGLANG_HOST_IP", "HOST_IP"):
        assert env[key] == "127.0.0.1"
    assert env["DYN_ZMQ_BROKER_URL"] == f"xsub=tcp://127.0.0.1:{plan.broker_xsub} , xpub=tcp://127.0.0.1:{plan.broker_xpub}"
    assert (env["DYN_DISCOVERY_BACKEND"], env["DYN_REQUEST_PLANE"], env["DYN_EVENT_PLANE"]) == ("file", "tcp", "zmq")
    specs = plan_specs(plan, CpuWorkerKind())
    assert [s.name for s in specs] == ["broker", "prefill0", "prefill1", "decode0", "frontend"]
    assert all(s.env.get(RUN_MARKER_ENV) == str(plan.run_dir) for s in specs)
    assert [s.infrastructure for s in specs] == [True, False, False, False, False]
    fe = specs[-1].argv
    assert fe[fe.index("--http-host") + 1] == "127.0.0.1" and fe[fe.index("--router-mode") + 1] == "kv"
    assert fe[fe.index("--kv-cache-block-size") + 1] == "16" and specs[-1].env["DYN_ROUTER_MIN_INITIAL_WORKERS"] == "1"
    for s in specs[1:-1]:
        wp = plan.worker_ports[s.name]
        assert (s.env["DYN_TCP_RPC_PORT"], s.env["DYN_SYSTEM_PORT"]) == (str(wp.rpc), str(wp.system))


def test_cpu_worker_command_round_trips_through_the_worker_parser(disagg_plan, monkeypatch):
    plan = disagg_plan
    kind = CpuWorkerKind(bootstrap_endpoint=False)
    by_name = {w.name: w for w in plan.topology.workers}
    args = {n: cpu_worker.parse_args(kind.command(w, plan).argv[3:]) for n, w in by_name.items()}
    p0, d0 = args["prefill0"], args["decode0"]
    assert (p0.disaggregation_mode, p0.component, p0.page_size, p0.speculative_algorithm) == ("prefill", "prefill", 16, "EAGLE3")
    assert p0.no_bootstrap_endpoint and p0.register_eagle == "auto" and p0.namespace == plan.namespace
    assert d0.disaggregation_mode == "decode" and d0.component == "backend" and d0.kv_events_config is None
    assert p0.disaggregation_bootstrap_port != args["prefill1"].disaggregation_bootstrap_port
    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    assert cpu_worker.relay_endpoint(p0.kv_events_config) == plan.kv_events_connect(by_name["prefill0"])


def test_kv_events_config_is_accepted_by_sglang_and_binds_loopback(disagg_plan):
    from kvalign.oracles.sglang import _modules

    _modules()
    from sglang.srt.disaggregation.kv_events import KVEventsConfig

    w = disagg_plan.topology.workers[0]
    cfg = KVEventsConfig.from_cli(disagg_plan.kv_events_config(w))
    assert (cfg.publisher, cfg.bind, cfg.topic) == ("zmq", True, "")
    assert cfg.endpoint == disagg_plan.kv_events_connect(w)
    assert json.loads(disagg_plan.kv_events_config(w))["endpoint"].startswith("tcp://127.0.0.1:")


def test_negative_control_flag_reaches_the_worker(tmp_path):
    plan = make_plan(Topology.aggregated(1, eagle=True, register_eagle=False), tmp_path)
    argv = CpuWorkerKind().command(plan.topology.workers[0], plan).argv
    a = cpu_worker.parse_args(argv[3:])
    assert a.speculative_algorithm == "EAGLE3" and a.register_eagle == "off"


def test_eagle_flag_is_derived_with_sglangs_own_predicate():
    from kvalign.oracles.sglang import _modules

    _modules()
    assert cpu_worker.eagle_enabled_for("EAGLE3") and cpu_worker.eagle_enabled_for("EAGLE")
    assert not cpu_worker.eagle_enabled_for(None) and not cpu_worker.eagle_enabled_for("NOT-AN-ALGORITHM")


def test_etcd_nats_plan_starts_both_services_on_loopback_first(tmp_path):
    plan = make_plan(Topology.disaggregated(2, 1, eagle=True), tmp_path, control_plane="etcd-nats")
    assert plan.broker_xsub is None and plan.broker_xpub is None
    ports = [plan.http_port, plan.etcd_client, plan.etcd_peer, plan.nats_port]
    ports += [p for wp in plan.worker_ports.values() for p in wp.all()]
    assert len(set(ports)) == len(ports) == 4 + 5 * 3
    env = plan.plane_env()
    assert (env["DYN_DISCOVERY_BACKEND"], env["DYN_REQUEST_PLANE"], env["DYN_EVENT_PLANE"]) == ("etcd", "tcp", "nats")
    assert env["ETCD_ENDPOINTS"] == f"http://127.0.0.1:{plan.etcd_client}"
    assert env["NATS_SERVER"] == f"nats://127.0.0.1:{plan.nats_port}"
    assert "DYN_FILE_KV" not in env and "DYN_ZMQ_BROKER_URL" not in env
    assert plan.discovery_store.endpoint == env["ETCD_ENDPOINTS"]

    specs = plan_specs(plan, CpuWorkerKind())
    assert [s.name for s in specs] == ["etcd", "nats", "prefill0", "prefill1", "decode0", "frontend"]
    assert [s.infrastructure for s in specs] == [True, True, False, False, False, False]  # stopped last
    etcd, nats, fe = specs[0].argv, specs[1].argv, specs[-1].argv
    opt = lambda argv, flag: argv[argv.index(flag) + 1]  # noqa: E731
    for flag in ("--listen-client-urls", "--advertise-client-urls"):
        assert opt(etcd, flag) == f"http://127.0.0.1:{plan.etcd_client}"
    assert opt(etcd, "--listen-peer-urls") == opt(etcd, "--initial-advertise-peer-urls") == f"http://127.0.0.1:{plan.etcd_peer}"
    assert opt(etcd, "--data-dir") == str(tmp_path.resolve() / "etcd")
    assert (opt(nats, "-a"), opt(nats, "-p")) == ("127.0.0.1", str(plan.nats_port)) and "-js" not in nats
    assert [opt(fe, f) for f in ("--discovery-backend", "--request-plane", "--event-plane")] == ["etcd", "tcp", "nats"]
    assert all(s.env[RUN_MARKER_ENV] == str(plan.run_dir) for s in specs)
    assert all(s.env["ETCD_ENDPOINTS"] == env["ETCD_ENDPOINTS"] for s in specs[2:])


def test_file_plane_is_the_default_and_unknown_planes_are_refused(tmp_path):
    plan = make_plan(Topology.aggregated(1, eagle=True), tmp_path / "a")
    assert plan.control_plane == "file" and plan.discovery_store == plan.file_kv and plan.etcd_client is None
    with pytest.raises(ValueError, match="unknown control plane 'consul'"):
        make_plan(Topology.aggregated(1, eagle=True), tmp_path / "b", control_plane="consul")


def test_missing_control_plane_binaries_are_named(monkeypatch):
    from kvalign.live.cluster import topology

    assert topology.control_plane_missing("file") is None
    monkeypatch.setattr(topology.shutil, "which", lambda name, path=None: None)
    reason = topology.control_plane_missing("etcd-nats")
    assert reason is not None and "needs etcd and nats-server" in reason and "apt-get install etcd-server nats-server" in reason
    assert topology.control_binary("etcd") == "etcd"  # a plan still prints the bare name
