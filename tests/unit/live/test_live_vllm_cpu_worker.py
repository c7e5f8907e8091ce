"""The vLLM CPU worker kind (``--engine vllm-cpu``): its command line, vLLM's reuse rule, the fuzz's
option gate, and the relay redirection of :mod:`kvalign.live.engines.vllm_worker`.

The workers themselves run in tests/e2e/test_vllm_cpu.py; here: what they are started with.
"""

from __future__ import annotations

import json
from types import ModuleType, SimpleNamespace

import pytest

from kvalign.live.cluster.lifecycle import make_plan
from kvalign.live.cluster.topology import Topology
from kvalign.live.engines import vllm_cpu, vllm_worker
from kvalign.live.engines.kinds import ENGINE_KINDS
from kvalign.live.runs.fuzz.views import engine_cached_tokens, last_page_overcredit


def _flags(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def _plan(tmp_path, n: int = 2, page_size: int = 32):
    plan = make_plan(Topology.aggregated(n, eagle=False, page_size=page_size), tmp_path, str(tmp_path / "model"),
                     model_name="tiny")
    return plan, vllm_cpu.VllmCpuWorkerKind("/env/bin/python", max_total_tokens=512)


def test_worker_command_is_dynamo_vllm_with_events_on_an_ipc_socket_and_loopback_relay(tmp_path):
    plan, kind = _plan(tmp_path)
    kind.relay_subscribe = {"worker1": "tcp://127.0.0.1:9"}
    for w in plan.topology.workers:
        spec = kind.command(w, plan)
        f = _flags(spec.argv)
        assert spec.argv[:3] == ["/env/bin/python", "-m", "kvalign.live.engines.vllm_worker"]
        assert f["--block-size"] == "32" and "--enable-prefix-caching" in f and "--enforce-eager" in f
        assert f["--max-model-len"] == "512"
        assert f["--num-gpu-blocks-override"] == str(512 // 32 + 1)  # the pool's tokens + vLLM's null block
        config = json.loads(f["--kv-events-config"] or "null")
        assert config["enable_kv_cache_events"] and config["publisher"] == "zmq" and config["topic"] == ""
        assert config["endpoint"] == kind.kv_ipc(w, plan) and config["endpoint"].startswith("ipc://")
        assert spec.env["DYN_TCP_RPC_PORT"] == str(plan.worker_ports[w.name].rpc)
        assert spec.env["PYTHONPATH"].split(":")[0] == str(vllm_cpu.SITE_DIR) and spec.env[vllm_cpu.SHIM_ENV] == "1"
        assert (vllm_cpu.SITE_DIR / "sitecustomize.py").is_file()
        assert spec.env["VLLM_HOST_IP"] == "127.0.0.1" and spec.env["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
    assert kind.command(plan.topology.workers[0], plan).env[vllm_worker.RELAY_SUBSCRIBE_ENV] == \
        plan.kv_events_connect(plan.topology.workers[0])
    assert kind.command(plan.topology.workers[1], plan).env[vllm_worker.RELAY_SUBSCRIBE_ENV] == "tcp://127.0.0.1:9"
    forwarders = kind.support_specs(plan)
    assert [s.name for s in forwarders] == ["worker0.kv-forwarder", "worker1.kv-forwarder"]
    assert forwarders[0].argv[-2:] == [kind.kv_ipc(plan.topology.workers[0], plan),
                                       plan.kv_events_connect(plan.topology.workers[0])]


def test_workers_stop_without_dynamos_and_vllms_graces_by_a_name_the_installed_dynamo_reads(tmp_path):
    """A stop sat out Dynamo's 5 s graceful-shutdown sleep and vLLM's 5 s executor grace; a misspelt name would
    bring them back unseen, so Dynamo's is held to the installed ``dynamo`` package's source (no import)."""
    import importlib.util
    from pathlib import Path

    plan, kind = _plan(tmp_path)
    for w in plan.topology.workers:
        env = kind.command(w, plan).env
        assert {k: env[k] for k in vllm_cpu.SHUTDOWN_GRACE} == vllm_cpu.SHUTDOWN_GRACE
    assert vllm_cpu.SHUTDOWN_GRACE["DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS"] == "0"
    dynamo = Path(importlib.util.find_spec("dynamo").submodule_search_locations[0])
    assert "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS" in (dynamo / "common" / "utils" / "graceful_shutdown.py").read_text()


@pytest.mark.parametrize("topology, why", [
    (Topology.disaggregated(1, 1, eagle=False, page_size=32), "aggregated only"),
    (Topology.aggregated(1, eagle=True, page_size=32), "no speculative decoder"),
    (Topology.aggregated(1, eagle=False, page_size=16), "multiple of 32"),
])
def test_worker_refuses_what_the_cpu_build_cannot_run(tmp_path, topology, why):
    plan = make_plan(topology, tmp_path, str(tmp_path / "model"), model_name="tiny")
    with pytest.raises(ValueError, match=why):
        vllm_cpu.VllmCpuWorkerKind("/py").command(plan.topology.workers[0], plan)


@pytest.mark.parametrize("b", [32, 64])
def test_block_size_rule(b):
    assert vllm_cpu.block_size_problem(b) is None
    assert "multiple of 32" in vllm_cpu.block_size_problem(b // 2 + 1)


def test_reuse_rule_whole_blocks_of_the_prompt_minus_its_last_token():
    """vLLM 0.32 caps a hit at num_tokens - 1 and counts whole blocks (kv_cache_manager.py:290-298)."""
    b = 32
    assert vllm_cpu.engine_reused_tokens(3, 96, b) == 64  # a prompt ending on a boundary: its last block recomputed
    assert vllm_cpu.engine_reused_tokens(3, 97, b) == 96
    assert vllm_cpu.engine_reused_tokens(1, 200, b) == 32  # never more than the cache holds
    assert vllm_cpu.engine_reused_tokens(5, 1, b) == 0 and vllm_cpu.engine_reused_tokens(0, 0, b) == 0
    with pytest.raises(ValueError):
        vllm_cpu.engine_reused_tokens(-1, 10, b)
    # the same count as SGLang's plain-key rule; the router's one allowed overcredit is the boundary block
    for n in range(1, 200):
        for h in range(0, 8):
            assert vllm_cpu.engine_reused_tokens(h, n, b) == engine_cached_tokens(h, n, b, eagle=False)
    assert last_page_overcredit(96, vllm_cpu.engine_reused_tokens(3, 96, b), 96, b, eagle=False)


def _fuzz_opts(**kw):
    base = dict(topology="agg", page_size=32, sglang=None, dp_size=1, hicache=None, event_format="default",
                publisher_faults=False, draft="agree", router_eagle=True, routers=1, router_mode="events")
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("kw, named", [
    ({"topology": "disagg"}, "aggregated workers"), ({"page_size": 16}, "--page-size 32"),
    ({"dp_size": 2}, "--dp-size"), ({"routers": 2, "hicache": object()}, "--hicache, --routers 2+"),
])
def test_fuzz_problem_names_what_the_vllm_workers_do_not_run(kw, named):
    assert named in vllm_cpu.fuzz_problem(_fuzz_opts(**kw))


def test_fuzz_problem_is_the_environment_on_plain_options(monkeypatch):
    from kvalign.releases import vllm_env

    monkeypatch.setattr(vllm_env, "installed", lambda *a: False)
    assert "vLLM's environment is not installed" in vllm_cpu.fuzz_problem(_fuzz_opts())
    monkeypatch.setattr(vllm_env, "installed", lambda *a: True)
    assert vllm_cpu.fuzz_problem(_fuzz_opts()) is None


def test_engine_kind_is_aggregated_without_speculation_and_checks_the_block_size():
    kind = ENGINE_KINDS["vllm-cpu"]
    opts = SimpleNamespace(prefill=2, page_size=32, sglang=None, draft="agree", hicache=None, transfer=None,
                           checksum_mismatch_prob=0.0, dynamo=None, router_eagle=True)
    kind.validate(opts)
    topo = kind.topology(opts)
    assert [w.role for w in topo.workers] == ["agg", "agg"] and not any(w.eagle for w in topo.workers)
    assert not kind.speculates and kind.gpus_needed(opts) == 0
    with pytest.raises(ValueError, match="multiple of 32"):
        kind.validate(SimpleNamespace(**{**vars(opts), "page_size": 16}))
    with pytest.raises(ValueError, match="--draft disagree"):
        kind.validate(SimpleNamespace(**{**vars(opts), "draft": "disagree"}))


def test_relay_via_points_only_dynamo_vllm_main_at_the_endpoint():
    class Publisher:
        @staticmethod
        def offset_endpoint_port(endpoint, data_parallel_rank):
            return endpoint

    main = ModuleType("dynamo.vllm.main")
    main.ZmqEventPublisher = Publisher
    vllm_worker.relay_via("tcp://127.0.0.1:7", main)
    assert main.ZmqEventPublisher.offset_endpoint_port("ipc:///x", 0) == "tcp://127.0.0.1:7"
    assert Publisher.offset_endpoint_port("ipc:///x", 0) == "ipc:///x"  # vLLM's own class untouched
    with pytest.raises(SystemExit, match="rank 1"):
        main.ZmqEventPublisher.offset_endpoint_port("ipc:///x", 1)


def test_relay_via_fails_loudly_when_dynamo_moved_the_call():
    with pytest.raises(SystemExit, match="no ZmqEventPublisher"):
        vllm_worker.relay_via("tcp://127.0.0.1:7", ModuleType("dynamo.vllm.main"))


def test_worker_refuses_to_start_without_a_relay_endpoint(monkeypatch):
    monkeypatch.delenv(vllm_worker.RELAY_SUBSCRIBE_ENV, raising=False)
    with pytest.raises(SystemExit, match=vllm_worker.RELAY_SUBSCRIBE_ENV):
        vllm_worker.main([])


def test_block_hash_encoding_is_read_as_vllm_reads_it():
    """``bool(int(value))``, default int (vllm/envs.py); the environment a restart step sets for each encoding."""
    assert vllm_cpu.hash_encoding({}) == "int"
    assert vllm_cpu.hash_encoding({vllm_cpu.INT_BLOCK_HASHES_ENV: "0"}) == "bytes"
    assert vllm_cpu.hash_encoding({vllm_cpu.INT_BLOCK_HASHES_ENV: "2"}) == "int"
    with pytest.raises(ValueError, match="reads it as an integer"):
        vllm_cpu.hash_encoding({vllm_cpu.INT_BLOCK_HASHES_ENV: "no"})
    for encoding in ("int", "bytes"):
        assert vllm_cpu.hash_encoding(vllm_cpu.block_hashes_env(encoding)) == encoding
    with pytest.raises(ValueError, match="int or bytes"):
        vllm_cpu.block_hashes_env("hex")
