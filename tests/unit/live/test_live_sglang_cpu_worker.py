"""The real-engine CPU worker kind's commands and the tiny offline models it serves.

The workers themselves run in tests/e2e/test_disagg_eagle.py (``sglang-cpu``); here: what they are
started with, and that the models are what the negative controls rely on.
"""

from __future__ import annotations

import json

import pytest

from kvalign.standins import sglang_cpu as sglang_cpu_standin
from kvalign.live.engines import engine_model
from kvalign.live.runs.scenario import prompt_tokens
from kvalign.live.engines.sglang_cpu import CpuEagle, checksum_injector_arm_path, plan_cluster
from kvalign.standins.sglang_cpu.kv_transfer import CHECKSUM_INJECTOR_ARM_ENV, CHECKSUM_LEDGER_ENV
from kvalign.live.cluster.topology import Topology


def _flags(argv: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[a] = None if nxt is None or nxt.startswith("--") else nxt
    return out


def test_disaggregated_commands(tmp_path):
    plan, kind = plan_cluster(Topology.disaggregated(2, 1, eagle=True), tmp_path)
    specs = {w.name: kind.command(w, plan) for w in plan.topology.workers}
    assert plan.model_name == engine_model.TARGET_NAME
    for name, spec in specs.items():
        f = _flags(spec.argv)
        assert spec.argv[1:3] == ["-m", "dynamo.sglang"]
        assert f["--nccl-port"] == str(plan.worker_ports[name].nccl)  # never SGLang's own ephemeral pick
        assert f["--device"] == "cpu" and f["--attention-backend"] == "torch_native" and f["--host"] == "127.0.0.1"
        assert f["--disaggregation-transfer-backend"] == "nixl" and f["--speculative-algorithm"] == "EAGLE3"
        assert "--disaggregation-enable-kv-checksum" in f  # SGLang's own checksum, the Adler-32 kernel stood in
        # every address the hand-off advertises or binds is the loopback; UCX runs over TCP on lo
        assert spec.env["SGLANG_HOST_IP"] == "127.0.0.1" and spec.env["UCX_NET_DEVICES"] == "lo"
        assert (f["--speculative-num-steps"], f["--speculative-eagle-topk"], f["--speculative-num-draft-tokens"]) == ("1", "1", "2")
        assert spec.env["PYTHONPATH"].split(":")[0] == str(sglang_cpu_standin.SITE_DIR)
        assert spec.env["SGLANG_USE_CPU_ENGINE"] == "1" and spec.env[sglang_cpu_standin.ENABLE_ENV] == "1"
        assert json.loads(f["--kv-events-config"] or "null") if name.startswith("prefill") else "--kv-events-config" not in f
    decode = _flags(specs["decode0"].argv)
    assert decode["--disaggregation-decode-retraction-backup"] == "cpu_tensor" and decode["--decode-log-interval"] == "1"
    assert specs["decode0"].env[CHECKSUM_LEDGER_ENV].endswith("decode0.checksums.jsonl")
    assert CHECKSUM_LEDGER_ENV not in specs["prefill0"].env
    assert json.loads(_flags(specs["prefill0"].argv)["--kv-events-config"])["endpoint"].startswith("tcp://127.0.0.1:")


def test_workers_stop_without_sglangs_crash_diagnostics_by_names_the_installed_sglang_reads(tmp_path):
    """A stop of a real worker sat out SGLang's 5 s before a py-spy dump and a CUDA coredump, neither of which
    exists on CPU. A misspelt name would be ignored by SGLang and the wait back, so each name must be one the
    installed SGLang declares (its ``srt/environ.py``, read as text: no SGLang import)."""
    import importlib.util
    from pathlib import Path

    from kvalign.live.engines.sglang_cpu import NO_CRASH_DIAGNOSTICS

    plan, kind = plan_cluster(Topology.aggregated(2, eagle=True), tmp_path)
    for w in plan.topology.workers:
        env = kind.command(w, plan).env
        assert {k: env[k] for k in NO_CRASH_DIAGNOSTICS} == NO_CRASH_DIAGNOSTICS == {
            "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
        assert env["OMP_NUM_THREADS"] == "1"
    environ = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt" / "environ.py"
    declared = environ.read_text()
    assert all(name in declared for name in NO_CRASH_DIAGNOSTICS)


def test_the_fake_backend_runs_no_checksum_and_the_injector_is_armed_only_when_asked(tmp_path):
    """``fake`` sends no digest (nothing to verify); the injector's arm file is named only for a control run."""
    plan, kind = plan_cluster(Topology.disaggregated(1, 1, eagle=True), tmp_path / "f", transfer="fake")
    for w in plan.topology.workers:
        spec = kind.command(w, plan)
        assert "--disaggregation-enable-kv-checksum" not in spec.argv and "fake" in spec.argv
        assert CHECKSUM_INJECTOR_ARM_ENV not in spec.env
    plan, kind = plan_cluster(Topology.disaggregated(1, 1, eagle=True), tmp_path / "i", checksum_mismatch_prob=0.5)
    env = {w.role: kind.command(w, plan).env for w in plan.topology.workers}
    assert env["decode"][CHECKSUM_INJECTOR_ARM_ENV] == str(checksum_injector_arm_path(plan))
    assert CHECKSUM_INJECTOR_ARM_ENV not in env["prefill"] and "SGLANG_TEST_DISAGG_KV_CHECKSUM_MISMATCH_PROB" not in env["decode"]
    with pytest.raises(ValueError, match="transfer backend must be one of nixl, fake"):
        plan_cluster(Topology.disaggregated(1, 1, eagle=True), tmp_path / "m", transfer="mooncake")


def test_negative_control_worker_forces_the_card_off_and_plain_workers_have_no_draft(tmp_path):
    plan, kind = plan_cluster(Topology.aggregated(2, eagle=True, register_eagle=False), tmp_path / "a")
    assert all(kind.command(w, plan).argv[1:3] == ["-m", "kvalign.live.engines.sglang_worker"] for w in plan.topology.workers)
    plan, kind = plan_cluster(Topology.aggregated(1, eagle=False), tmp_path / "b")
    argv = kind.command(plan.topology.workers[0], plan).argv
    assert "--speculative-algorithm" not in argv and "--disaggregation-mode" not in argv


def test_every_worker_sleeps_when_idle_unless_told_not_to(tmp_path):
    """An idle scheduler without --sleep-on-idle spins a core (bench/bench_live_idle.py: 1.66 of 2
    cores for an idle 2 prefill + 1 decode cluster); the benchmark's spinning side turns it off."""
    plan, kind = plan_cluster(Topology.disaggregated(2, 1, eagle=True), tmp_path)
    assert all("--sleep-on-idle" in kind.command(w, plan).argv for w in plan.topology.workers)
    kind.sleep_on_idle = False
    assert not any("--sleep-on-idle" in kind.command(w, plan).argv for w in plan.topology.workers)


def test_only_the_eagle_settings_torch_native_can_run():
    with pytest.raises(ValueError, match="num-steps 1"):
        CpuEagle(num_steps=3)
    with pytest.raises(ValueError, match="num-steps 1"):
        CpuEagle(eagle_topk=2)


def test_models_are_deterministic_and_heads_set_acceptance(tmp_path):
    from safetensors.torch import load_file  # torch: when this test runs, not at collection

    t1, agree = engine_model.write_models(tmp_path / "1", "agree")
    t2, _ = engine_model.write_models(tmp_path / "2", "agree")
    _, disagree = engine_model.write_models(tmp_path / "3", "disagree")
    assert (t1 / "model.safetensors").read_bytes() == (t2 / "model.safetensors").read_bytes()
    target, good, bad = (load_file(str(d / "model.safetensors")) for d in (t1, agree, disagree))
    assert not target["lm_head.weight"].any() and not good["lm_head.weight"].any()  # both argmax to id 0
    assert bad["lm_head.weight"].abs().min() > 0  # the negative control's draft proposes other tokens
    assert target["model.embed_tokens.weight"].shape == (engine_model.VOCAB, engine_model.HIDDEN)
    assert good["fc.weight"].shape == (engine_model.HIDDEN, 3 * engine_model.HIDDEN)
    assert good["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * engine_model.HIDDEN
    cfg = json.loads((agree / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert json.loads((t1 / "config.json").read_text())["num_hidden_layers"] == 4


def test_id_zero_is_the_word_the_zero_head_generates(tmp_path):
    target, _ = engine_model.write_models(tmp_path, "agree")
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(target))
    assert tok.decode([0]) == engine_model.LEADING_WORD
    assert len(prompt_tokens(str(target), "the quick brown fox")) == 4 + 3


def test_a_release_without_bind_gets_an_ipc_publisher_and_a_loopback_forwarder(tmp_path, monkeypatch):
    """0.5.21 from the wheel cache (a directory given, nothing installed here: only the commands)."""
    from kvalign.live.engines.sglang_cpu import SglangCpuWorkerKind
    from kvalign.releases.release_env import python_for

    monkeypatch.setenv("KVALIGN_WHEEL_CACHE", str(tmp_path / "cache"))
    plan, _ = plan_cluster(Topology.disaggregated(2, 1, eagle=True), tmp_path)
    release = tmp_path / "sglang-0.5.21"
    kind = SglangCpuWorkerKind("draft", sglang_version="0.5.21", sglang_dir=release)
    forwarders = kind.support_specs(plan)
    assert [s.name for s in forwarders] == ["prefill0.kv-forwarder", "prefill1.kv-forwarder"]
    for spec, worker in zip(forwarders, plan.topology.by_role("prefill")):
        ipc, bind = spec.argv[-2:]
        assert spec.argv[1:3] == ["-m", "kvalign.live.wire.kv_forwarder"] and spec.infrastructure
        assert bind == plan.kv_events_connect(worker) and bind.startswith("tcp://127.0.0.1:")
        command = kind.command(worker, plan)
        config = json.loads(_flags(command.argv)["--kv-events-config"])
        assert "bind" not in config and config["endpoint"] == bind  # the relay's address, served by the forwarder
        assert command.env[sglang_cpu_standin.KV_EVENTS_IPC_ENV] == ipc and ipc.startswith("ipc://")
        # the release's own environment runs the worker; the stand-in alone on PYTHONPATH, before it
        assert command.argv[0] == python_for([release]) != plan.python
        assert command.env["PYTHONPATH"] == str(sglang_cpu_standin.SITE_DIR)
        assert command.env["TORCH_EXTENSIONS_DIR"].endswith("sglang-0.5.21")
    current = SglangCpuWorkerKind("draft")  # the environment's 0.5.23 binds its own PUB
    assert current.support_specs(plan) == [] and sglang_cpu_standin.KV_EVENTS_IPC_ENV not in current.command(
        plan.topology.workers[0], plan).env


def test_forwarder_binds_only_loopback():
    from kvalign.live.wire.kv_forwarder import check_bind, main

    assert check_bind("tcp://127.0.0.1:25000") == "tcp://127.0.0.1:25000"
    for bad in ("tcp://0.0.0.0:25000", "tcp://*:25000", "ipc:///tmp/x", "tcp://127.0.0.1"):
        with pytest.raises(ValueError, match="binds only tcp://127.0.0.1:PORT"):
            check_bind(bad)
    assert main(["ipc:///tmp/x", "tcp://0.0.0.0:25000"]) == 2


@pytest.mark.parametrize(("argv", "message"), [
    (["e2e", "run", "--engine", "sglang-cpu", "--sglang", "0.5.21;x"], "--sglang takes one release version"),
    (["e2e", "run", "--engine", "fake-cpu", "--sglang", "0.5.21"], "--sglang picks the real CPU engine's SGLang"),
    (["e2e", "plan", "--engine", "sglang-cpu", "--sglang", "0.5.17"], "supports sglang 0.5.19, 0.5.21, 0.5.23"),
    (["live", "plan", "--engine", "fake-cpu", "--sglang", "0.5.21"], "--sglang picks the real CPU engine's SGLang"),
    (["live", "plan", "--engine", "sglang-cpu", "--dynamo", "1.3.1"], "runs kvalign's fake CPU workers"),
    (["live", "plan", "--dynamo", "1.3;x"], "--dynamo takes one release version"),
])
def test_sglang_release_flag_bad_input_is_one_line_exit_2(capsys, argv, message):
    from kvalign.cli import main

    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and message in err, err
