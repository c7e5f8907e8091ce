"""The ``dynamo.sglang`` worker commands of the GPU layer, checked against the real parsers.

Each generated command line is parsed the way ``dynamo.sglang.args.parse_args`` parses it:
Dynamo's own runtime and SGLang-backend argument groups, Dynamo's worker-router flags, then
SGLang's ``ServerArgs.add_cli_args`` parser for the rest — so a misspelt flag or a wrong value
type fails here, on CPU, not after the nightly has loaded 16 GB of weights.
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

import pytest

from kvalign.live.cluster.lifecycle import make_plan
from kvalign.live.engines.sglang_worker import (
    DEFAULT_DRAFT_MODEL,
    DEFAULT_MODEL,
    SglangWorkerKind,
    default_models,
    gpu_topology,
    router_eagle_from,
)
from kvalign.live.cluster.topology import Topology


def _plan(tmp_path: Path, **topo):
    return make_plan(gpu_topology(**topo), tmp_path / "run", DEFAULT_MODEL)


def _specs(tmp_path: Path, kind: SglangWorkerKind | None = None, **topo):
    plan = _plan(tmp_path, **topo)
    kind = kind or SglangWorkerKind(DEFAULT_DRAFT_MODEL)
    return plan, {w.name: kind.command(w, plan) for w in plan.topology.workers}


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture(scope="module")
def parse_like_dynamo_sglang():
    """``dynamo.sglang``'s two-stage CLI parse, from the installed Dynamo and SGLang."""
    try:
        from kvalign.oracles.sglang import _modules

        _modules()
        from dynamo.common.configuration.groups.router_args import parse_worker_router_config, register_worker_router_help
        from dynamo.common.configuration.groups.runtime_args import DynamoRuntimeArgGroup
        from dynamo.sglang._compat import add_sglang_cli_compat
        from dynamo.sglang.backend_args import DynamoSGLangArgGroup
        from sglang.srt.server_args import ServerArgs
    except Exception as exc:  # noqa: BLE001 - any import failure means "cannot check here"
        pytest.skip(f"Dynamo/SGLang argument parsers unavailable: {type(exc).__name__}: {exc}")

    def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
        dyn = argparse.ArgumentParser(exit_on_error=False)
        DynamoRuntimeArgGroup().add_arguments(dyn)
        DynamoSGLangArgGroup().add_arguments(dyn)
        register_worker_router_help(dyn)
        dynamo_args, rest = dyn.parse_known_args(argv)
        _, rest = parse_worker_router_config(rest)
        sg = argparse.ArgumentParser(add_help=False, exit_on_error=False)
        ServerArgs.add_cli_args(sg)
        add_sglang_cli_compat(sg)
        return dynamo_args, sg.parse_args(rest)

    return parse


def test_default_topology_is_two_prefill_on_gpu0_one_decode_on_gpu1(tmp_path):
    plan, specs = _specs(tmp_path)
    assert list(specs) == ["prefill0", "prefill1", "decode0"]
    assert {n: s.env["CUDA_VISIBLE_DEVICES"] for n, s in specs.items()} == {"prefill0": "0", "prefill1": "0", "decode0": "1"}
    assert {n: _flag(s.argv, "--disaggregation-mode") for n, s in specs.items()} == {
        "prefill0": "prefill", "prefill1": "prefill", "decode0": "decode"}
    assert {n: _flag(s.argv, "--mem-fraction-static") for n, s in specs.items()} == {
        "prefill0": "0.4", "prefill1": "0.4", "decode0": "0.8"}
    for s in specs.values():
        assert s.argv[1:3] == ["-m", "dynamo.sglang"]
        assert _flag(s.argv, "--host") == "0.0.0.0"
        assert _flag(s.argv, "--page-size") == "16"
        assert _flag(s.argv, "--speculative-algorithm") == "EAGLE3"
        assert _flag(s.argv, "--speculative-draft-model-path") == DEFAULT_DRAFT_MODEL
        assert _flag(s.argv, "--model-path") == DEFAULT_MODEL
        assert _flag(s.argv, "--served-model-name") == plan.model_name
        for key, value in {"PYTHONHASHSEED": "0", "UCX_TLS": "^mm", "DYN_DISCOVERY_BACKEND": "file",
                           "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq", "SGLANG_HOST_IP": "127.0.0.1",
                           "HF_HUB_OFFLINE": "1"}.items():
            assert s.env[key] == value, key


def test_every_worker_gets_its_own_ports(tmp_path):
    plan, specs = _specs(tmp_path)
    bootstrap = [_flag(s.argv, "--disaggregation-bootstrap-port") for s in specs.values()]
    kv = [json.loads(_flag(s.argv, "--kv-events-config"))["endpoint"] for s in specs.values()]
    system = [s.env["DYN_SYSTEM_PORT"] for s in specs.values()]
    allports = bootstrap + [e.rsplit(":", 1)[1] for e in kv] + system + [plan.http_port]
    assert len(set(map(str, allports))) == len(allports)
    assert all(e.startswith("tcp://*:") for e in kv)


def test_only_decode_exports_spec_metrics_every_forward(tmp_path):
    _, specs = _specs(tmp_path)
    for name, s in specs.items():
        is_decode = name.startswith("decode")
        assert ("--enable-metrics" in s.argv) == is_decode, name
        assert ("--decode-log-interval" in s.argv) == is_decode, name
        if is_decode:
            assert _flag(s.argv, "--decode-log-interval") == "1"


def test_single_gpu_mode_splits_gpu0(tmp_path):
    _, specs = _specs(tmp_path, single_gpu=True)
    assert {s.env["CUDA_VISIBLE_DEVICES"] for s in specs.values()} == {"0"}
    fractions = [float(_flag(s.argv, "--mem-fraction-static")) for s in specs.values()]
    assert fractions == [0.26, 0.26, 0.26] and sum(fractions) <= 0.8


def test_commands_parse_with_the_real_dynamo_sglang_parsers(tmp_path, parse_like_dynamo_sglang):
    plan, specs = _specs(tmp_path)
    for name, s in specs.items():
        dyn, sg = parse_like_dynamo_sglang(s.argv[3:])
        assert sg.page_size == 16
        assert sg.speculative_algorithm == "EAGLE3" and sg.speculative_num_draft_tokens == 4
        assert sg.speculative_num_steps == 3 and sg.speculative_eagle_topk == 1
        assert sg.host == "0.0.0.0"
        assert sg.disaggregation_bootstrap_port == plan.worker_ports[name].bootstrap
        assert sg.nccl_port == plan.worker_ports[name].nccl
        assert sg.disaggregation_mode == ("decode" if name.startswith("decode") else "prefill")
        assert json.loads(sg.kv_events_config)["publisher"] == "zmq"
        if name.startswith("decode"):
            assert sg.enable_metrics is True and sg.decode_log_interval == 1
        else:
            assert sg.enable_metrics is False


def test_kv_events_endpoint_is_bound_by_sglang_and_reached_on_loopback(tmp_path):
    """SGLang's own publisher config accepts it, binds it, and its rank-0 port is ours."""
    try:
        from kvalign.oracles.sglang import _modules

        _modules()
        from sglang.srt.disaggregation.kv_events import KVEventsConfig, ZmqEventPublisher
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"SGLang KV-event config unavailable: {type(exc).__name__}: {exc}")
    plan, specs = _specs(tmp_path)
    for worker in plan.topology.by_role("prefill"):
        cfg = KVEventsConfig.from_cli(_flag(specs[worker.name].argv, "--kv-events-config"))
        port = plan.worker_ports[worker.name].kv_events
        assert ZmqEventPublisher.offset_endpoint_port(cfg.endpoint, 0) == f"tcp://*:{port}"
        assert plan.kv_events_connect(worker) == f"tcp://127.0.0.1:{port}"


def test_loopback_bind_host_uses_sglang_bind_flag(tmp_path):
    _, specs = _specs(tmp_path, kind=SglangWorkerKind(DEFAULT_DRAFT_MODEL, bind_host="127.0.0.1"))
    for s in specs.values():
        cfg = json.loads(_flag(s.argv, "--kv-events-config"))
        assert _flag(s.argv, "--host") == "127.0.0.1"
        assert cfg["endpoint"].startswith("tcp://127.0.0.1:") and cfg["bind"] is True


def test_negative_control_runs_through_the_eagle_off_entry(tmp_path):
    _, specs = _specs(tmp_path, router_eagle=False)
    for s in specs.values():
        assert s.argv[1:3] == ["-m", "kvalign.live.engines.sglang_worker"]
        assert _flag(s.argv, "--speculative-algorithm") == "EAGLE3"  # the engine still keys by bigrams


def test_negative_control_hook_exists_in_installed_dynamo():
    """The entry patches ``dynamo.sglang.register._eagle_enabled_for``; if Dynamo renames it the
    control would silently stay positive, so check the installed source still routes
    ``runtime_config.enable_eagle`` through it (static: the module needs a GPU stack to import)."""
    import importlib.util

    spec = importlib.util.find_spec("dynamo")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("ai-dynamo is not installed")
    src = Path(list(spec.submodule_search_locations)[0]) / "sglang" / "register.py"
    if not src.is_file():
        pytest.skip(f"{src} not found")
    tree = ast.parse(src.read_text())
    defs = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    assert "_eagle_enabled_for" in defs
    guarded = [
        n for n in ast.walk(tree) if isinstance(n, ast.If) and isinstance(n.test, ast.Call)
        and getattr(n.test.func, "id", None) == "_eagle_enabled_for"
        and any(isinstance(t, ast.Attribute) and t.attr == "enable_eagle"
                for b in n.body if isinstance(b, ast.Assign) for t in b.targets)
    ]
    assert guarded, "runtime_config.enable_eagle is no longer set under _eagle_enabled_for(...)"


def test_negative_control_patch_takes_effect():
    try:
        import dynamo.sglang.register as register
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"dynamo.sglang does not import here: {type(exc).__name__}: {exc}")
    from kvalign.live.engines.sglang_worker import force_router_eagle_off

    original = register._eagle_enabled_for
    try:
        assert original("EAGLE3") is True
        force_router_eagle_off()
        assert register._eagle_enabled_for("EAGLE3") is False
    finally:
        register._eagle_enabled_for = original


def test_models_from_environment():
    assert default_models({}) == (DEFAULT_MODEL, DEFAULT_DRAFT_MODEL)
    assert default_models({"KVALIGN_MODEL": "/m", "KVALIGN_DRAFT_MODEL": "/d"}) == ("/m", "/d")


@pytest.mark.parametrize("value,expected", [(None, True), ("on", True), ("OFF", False), ("0", False), ("", True)])
def test_router_eagle_switch(value, expected):
    assert router_eagle_from(value) is expected


def test_router_eagle_switch_rejects_typos():
    with pytest.raises(ValueError, match="'on' or 'off'"):
        router_eagle_from("of")


def test_aggregated_or_gpu_less_workers_are_rejected(tmp_path):
    kind = SglangWorkerKind(DEFAULT_DRAFT_MODEL)
    agg = make_plan(Topology.aggregated(1, eagle=True), tmp_path / "a", DEFAULT_MODEL)
    with pytest.raises(ValueError, match="aggregated"):
        kind.command(agg.topology.workers[0], agg)
    nogpu = make_plan(Topology.disaggregated(1, 1, eagle=True), tmp_path / "b", DEFAULT_MODEL)
    with pytest.raises(ValueError, match="no GPU"):
        kind.command(nogpu.topology.workers[0], nogpu)


@pytest.mark.parametrize("kwargs,match", [({"bind_host": "10.0.0.1"}, "bind host"), ({"mem_fraction_static": 1.5}, "mem-fraction")])
def test_bad_kind_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SglangWorkerKind(DEFAULT_DRAFT_MODEL, **kwargs)


@pytest.mark.slow  # a child process that imports dynamo.sglang with the stand-in
def test_relay_hop_patch_redirects_only_dynamos_subscriber_address():
    """In a worker-like process (the stand-in on PYTHONPATH, as the CPU workers run): before the
    patch Dynamo's relay would subscribe to SGLang's own endpoint, after it to the hop."""
    import os
    import subprocess
    import sys

    from kvalign.standins import sglang_cpu as sglang_cpu_standin
    from kvalign.live.engines.sglang_cpu import engine_problem

    if engine_problem():
        pytest.skip(f"the real engine's packages are missing: {engine_problem()}")
    code = ("import dynamo.sglang.publisher as p; from kvalign.live.engines.sglang_worker import relay_via; "
            "print(p.format_zmq_endpoint('tcp://*:5557', '127.0.0.1')); relay_via('tcp://127.0.0.1:6001'); "
            "print(p.format_zmq_endpoint('tcp://*:5557', '127.0.0.1'))")
    env = {**os.environ, **sglang_cpu_standin.worker_env(os.environ.get("PYTHONPATH"))}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:6001"]


def test_cpu_kind_routes_the_relay_through_the_hop_only_when_asked(tmp_path):
    from kvalign.live.engines.sglang_cpu import SglangCpuWorkerKind
    from kvalign.live.engines.sglang_worker import RELAY_SUBSCRIBE_ENV, ROUTER_EAGLE_ENV

    plan = make_plan(Topology.aggregated(2, eagle=True), tmp_path, DEFAULT_MODEL)
    kind = SglangCpuWorkerKind("/draft", relay_subscribe={"worker1": "tcp://127.0.0.1:6001"})
    w0, w1 = (kind.command(w, plan) for w in plan.topology.workers)
    assert w0.argv[1:3] == ["-m", "dynamo.sglang"] and RELAY_SUBSCRIBE_ENV not in w0.env
    assert w1.argv[1:3] == ["-m", "kvalign.live.engines.sglang_worker"] and w1.env[RELAY_SUBSCRIBE_ENV] == "tcp://127.0.0.1:6001"
    assert ROUTER_EAGLE_ENV not in w1.env  # the wrapper forces eagle off only when the topology says so
