"""``kvalign e2e plan``: the dry run prints exactly what a GPU run would launch, and starts nothing."""

from __future__ import annotations

import json
import re
import tempfile

import pytest

from kvalign.cli import main


def _plan(capsys, *args: str) -> str:
    assert main(["e2e", "plan", *args]) == 0
    return capsys.readouterr().out


def _blocks(out: str) -> dict[str, str]:
    """Process name -> its printed block (env line + command)."""
    parts = re.split(r"^\[\d+/\d+\] (\S+)$", out, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_default_plan_is_two_prefill_on_gpu0_and_decode_on_gpu1(capsys):
    """kvalign's tiny pair on SGLang's CUDA path (the GPU stand-in on the workers' path only)."""
    out = _plan(capsys)
    blocks = _blocks(out)
    assert list(blocks) == ["broker", "prefill0", "prefill1", "decode0", "frontend"]
    assert out.startswith("kvalign e2e plan: 2 prefill (GPU 0) + 1 decode (GPU 1), EAGLE3 (tiny Llama, kv pair, "
                          "agreeing draft), nixl transfer, page size 16")
    for name, gpu in (("prefill0", "0"), ("prefill1", "0"), ("decode0", "1")):
        b = " ".join(blocks[name].replace("\\\n", " ").split())  # one line: flags and their values together
        assert f"CUDA_VISIBLE_DEVICES={gpu}" in b and "standins/sglang_gpu/site" in b and "HF_HUB_OFFLINE=1" in b
        assert "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python" in b and "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1" in b
        assert "-m dynamo.sglang" in b and "--host 127.0.0.1" in b and "--page-size 16" in b
        assert "--device cuda --attention-backend triton --dtype bfloat16" in b and "--disaggregation-transfer-backend nixl" in b
        assert "--speculative-algorithm EAGLE3" in b and "--speculative-draft-model-path $RUN_DIR/models/draft-kv-agree" in b
        assert "--speculative-num-steps 3" in b and "--speculative-num-draft-tokens 4" in b
        assert "--enable-metrics" in b and "sglang_cpu" not in b
    assert "standins/sglang_gpu" not in blocks["frontend"] + blocks["broker"]


def test_plan_with_a_downloaded_model_runs_nixl_between_gpus(capsys):
    out = _plan(capsys, "--model", "Qwen/Qwen3-8B", "--draft-model", "Tengyunw/qwen3_8b_eagle3")
    blocks = _blocks(out)
    assert out.startswith("kvalign e2e plan: 2 prefill (GPU 0) + 1 decode (GPU 1), EAGLE3, nixl transfer, page size 16")
    for name, gpu in (("prefill0", "0"), ("prefill1", "0"), ("decode0", "1")):
        b = blocks[name]
        assert f"CUDA_VISIBLE_DEVICES={gpu} " in b and "UCX_TLS='^mm'" in b and "HF_HUB_OFFLINE=1" in b
        assert "-m dynamo.sglang" in b and "--host 0.0.0.0" in b and "--page-size 16" in b
        assert "--speculative-algorithm EAGLE3" in b and "--speculative-draft-model-path Tengyunw/qwen3_8b_eagle3" in b
        assert "--disaggregation-transfer-backend nixl" in b
        assert ("--enable-metrics" in b and "--decode-log-interval 1" in b) == (name == "decode0")


def test_single_gpu_plan_puts_everything_on_gpu0(capsys):
    out = _plan(capsys, "--single-gpu")
    blocks = _blocks(out)
    assert "1 decode (GPU 0)" in out.splitlines()[0]
    for name in ("prefill0", "prefill1", "decode0"):
        assert "CUDA_VISIBLE_DEVICES=0 " in blocks[name] and "--mem-fraction-static 0.26" in blocks[name]


def test_plan_creates_and_leaves_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out = _plan(capsys)
    assert list(tmp_path.iterdir()) == []
    assert str(tmp_path) not in out


def test_plan_json_lists_processes_and_missing_prerequisites(capsys):
    data = json.loads(_plan(capsys, "--json"))
    assert [p["name"] for p in data["processes"]] == ["broker", "prefill0", "prefill1", "decode0", "frontend"]
    decode = data["processes"][3]
    assert decode["env"]["CUDA_VISIBLE_DEVICES"] == "1" and decode["argv"][1:3] == ["-m", "dynamo.sglang"]
    assert data["router_eagle"] is True
    assert all(isinstance(p, str) and p for p in data["missing_prerequisites"])


@pytest.mark.parametrize("how", ["flag", "env"])
def test_negative_control_switch_changes_the_entry_point(capsys, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("KVALIGN_ROUTER_EAGLE", "off")
        out = _plan(capsys)
    else:
        out = _plan(capsys, "--router-eagle", "off")
    assert "NEGATIVE CONTROL: router eagle forced off" in out
    assert out.count("-m kvalign.live.engines.sglang_worker") == 3 and "-m dynamo.sglang" not in out


def test_flag_overrides_environment_switch(capsys, monkeypatch):
    monkeypatch.setenv("KVALIGN_ROUTER_EAGLE", "off")
    out = _plan(capsys, "--router-eagle", "on")
    assert out.count("-m dynamo.sglang") == 3


def test_models_from_env_and_options(capsys, monkeypatch, tmp_path):
    model = tmp_path / "MyModel"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    monkeypatch.setenv("KVALIGN_MODEL", str(model))
    monkeypatch.setenv("KVALIGN_DRAFT_MODEL", "/nonexistent/draft")
    out = _plan(capsys)
    assert f"--model-path {model}" in out and "--served-model-name MyModel" in out
    assert "--speculative-draft-model-path /nonexistent/draft" in out
    assert "draft model /nonexistent/draft: no such path" in out
    assert f"model {model}:" not in out
    out = _plan(capsys, "--draft-model", str(model))
    assert f"--speculative-draft-model-path {model}" in out


def test_cpu_plan_uses_the_same_harness_with_cpu_workers(capsys):
    blocks = _blocks(_plan(capsys, "--cpu"))
    assert list(blocks) == ["broker", "prefill0", "prefill1", "decode0", "frontend"]
    assert all("-m kvalign.live.engines.fake_cpu_worker" in blocks[n] for n in ("prefill0", "prefill1", "decode0"))
    assert "CUDA_VISIBLE_DEVICES" not in "".join(blocks.values())


def test_sglang_cpu_plan_runs_the_real_engine_with_the_stand_in(capsys):
    out = _plan(capsys, "--engine", "sglang-cpu", "--draft", "disagree")
    blocks = _blocks(out)
    assert "[NEGATIVE CONTROL: the draft never agrees with the target]" in out.splitlines()[0]
    for name in ("prefill0", "prefill1", "decode0"):
        assert "-m dynamo.sglang" in blocks[name] and "--device cpu" in blocks[name]
        assert "SGLANG_USE_CPU_ENGINE=1" in blocks[name] and "standins/sglang_cpu/site" in blocks[name]
        assert "--speculative-draft-model-path $RUN_DIR/models/draft-kv-disagree" in blocks[name]
        assert "--disaggregation-transfer-backend nixl" in blocks[name] and "--disaggregation-enable-kv-checksum" in blocks[name]
    assert "standins/sglang_cpu" not in blocks["frontend"] + blocks["broker"]  # only the workers load it


@pytest.mark.parametrize("args,message", [
    (["--engine", "sglang-cpu", "--single-gpu"], "--single-gpu applies to --engine sglang-gpu"),
    (["--engine", "sglang-cpu", "--cpu"], "--cpu means --engine fake-cpu"),
    (["--cpu", "--draft", "disagree"], "it needs --engine sglang-cpu or sglang-gpu"),
    (["--model", "Qwen/Qwen3-8B", "--hicache"], "run kvalign's tiny models"),
    (["--prefill", "0"], "need at least 1 prefill and 1 decode worker"),
    (["--requests", "1"], "at least 2 requests"),
    (["--page-size", "0"], "--page-size must be >= 1"),
    (["--single-gpu", "--cpu"], "not allowed with argument"),
])
def test_bad_options_are_one_line_errors(capsys, args, message):
    assert main(["e2e", "plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvalign: error: ") and message in err


@pytest.mark.slow  # probes every real-engine prerequisite (imports the engine's stack)
def test_run_refuses_with_every_missing_prerequisite(capsys):
    from kvalign.live.engines.gpu import visible_gpus

    if len(visible_gpus()[0]) >= 2:
        pytest.skip("this machine has 2 GPUs: `e2e run` would really start")
    assert main(["e2e", "run", "--model", "/nonexistent/m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvalign: error: cannot run here: needs 2 NVIDIA GPUs")
    assert "model /nonexistent/m: no such path" in err


def test_local_paths_never_leak_the_planning_dir(capsys):
    out = _plan(capsys, "--cpu")
    assert "--model-path $RUN_DIR/model" in out
    assert not re.search(r"kvalign-e2e-plan-\w+", out)


@pytest.mark.parametrize("gpu_args", [[], ["--cpu"]], ids=["gpu", "cpu"])
def test_etcd_nats_plan_prints_the_services_and_their_env(capsys, gpu_args):
    out = _plan(capsys, *gpu_args, "--control-plane", "etcd-nats")
    blocks = _blocks(out)
    assert list(blocks) == ["etcd", "nats", "prefill0", "prefill1", "decode0", "frontend"]
    assert "control plane etcd-nats" in out.splitlines()[0]
    assert "control plane: etcd-nats (discovery-backend etcd, request-plane tcp, event-plane nats)" in out
    etcd_port = re.search(r"\n  ETCD_ENDPOINTS=http://127\.0\.0\.1:(\d+)\n", out).group(1)
    nats_port = re.search(r"\n  NATS_SERVER=nats://127\.0\.0\.1:(\d+)\n", out).group(1)
    for line in ("DYN_DISCOVERY_BACKEND=etcd", "DYN_REQUEST_PLANE=tcp", "DYN_EVENT_PLANE=nats"):
        assert f"\n  {line}\n" in out, line
    assert "DYN_FILE_KV" not in out and "DYN_ZMQ_BROKER_URL" not in out
    assert f"--listen-client-urls http://127.0.0.1:{etcd_port}" in blocks["etcd"]
    assert "--data-dir $RUN_DIR/etcd" in blocks["etcd"]
    assert f"-a 127.0.0.1 -p {nats_port}" in blocks["nats"]
    assert "--discovery-backend etcd" in blocks["frontend"] and "--event-plane nats" in blocks["frontend"]
    assert all(b.lstrip().startswith("env: PLANE") for n, b in blocks.items() if n not in ("etcd", "nats"))
    assert "wait for etcd /health and the NATS INFO greeting" in out


def test_etcd_nats_plan_json(capsys):
    data = json.loads(_plan(capsys, "--cpu", "--json", "--control-plane", "etcd-nats"))
    procs = {p["name"]: p for p in data["processes"]}
    assert procs["etcd"]["argv"][0].endswith("etcd") and procs["nats"]["argv"][0].endswith("nats-server")
    assert procs["frontend"]["env"]["DYN_DISCOVERY_BACKEND"] == "etcd"
