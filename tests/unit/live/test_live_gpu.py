"""GPU and prerequisite detection: every missing piece gives its own precise reason."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvalign.live.engines import gpu

SMI = (
    "0, GPU-11111111-aaaa-bbbb-cccc-000000000000, NVIDIA H200, 143771\n"
    "1, GPU-22222222-aaaa-bbbb-cccc-000000000000, NVIDIA H200, 143771\n"
)


def test_parse_nvidia_smi_rows():
    gpus = gpu.parse_nvidia_smi(SMI + "\n")
    assert [(g.index, g.name, g.memory_mib) for g in gpus] == [(0, "NVIDIA H200", 143771), (1, "NVIDIA H200", 143771)]
    assert str(gpus[0]) == "0: NVIDIA H200, 143771 MiB"


def test_parse_nvidia_smi_rejects_other_output():
    with pytest.raises(ValueError, match="unexpected nvidia-smi row"):
        gpu.parse_nvidia_smi("No devices were found\n")


@pytest.mark.parametrize("cvd,expected", [
    (None, [0, 1]), ("1", [1]), ("1,0", [1, 0]), ("", []), ("-1", []), ("0,7,1", [0]),
    ("GPU-22222222", [1]), ("0,0", [0]),
])
def test_cuda_visible_devices_filter(cvd, expected):
    assert [g.index for g in gpu.filter_visible(gpu.parse_nvidia_smi(SMI), cvd)] == expected


def _fake_run(stdout: str = SMI, rc: int = 0, stderr: str = ""):
    def run(argv, **kw):
        assert argv[1:] == gpu.NVIDIA_SMI_QUERY
        return subprocess.CompletedProcess(argv, rc, stdout, stderr)
    return run


def test_visible_gpus_without_driver(tmp_path):
    gpus, why = gpu.visible_gpus({"PATH": str(tmp_path)})
    assert gpus == [] and why == "nvidia-smi not found (no NVIDIA driver on this machine)"


def _smi_on_path(tmp_path):
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return {"PATH": str(tmp_path)}


def test_visible_gpus_honours_cuda_visible_devices(tmp_path):
    env = {**_smi_on_path(tmp_path), "CUDA_VISIBLE_DEVICES": "1"}
    gpus, why = gpu.visible_gpus(env, run=_fake_run())
    assert [g.index for g in gpus] == [1] and why is None
    gpus, why = gpu.visible_gpus({**env, "CUDA_VISIBLE_DEVICES": ""}, run=_fake_run())
    assert gpus == [] and why == "CUDA_VISIBLE_DEVICES='' hides every GPU"


def test_visible_gpus_reports_a_failing_driver(tmp_path):
    gpus, why = gpu.visible_gpus(_smi_on_path(tmp_path), run=_fake_run("", 9, "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n"))
    assert gpus == [] and why == "nvidia-smi exited 9: NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."


def test_gpu_problem_wording():
    one = gpu.parse_nvidia_smi(SMI)[:1]
    assert gpu.gpu_problem(2, one, None) == "needs 2 NVIDIA GPUs, 1 visible (0: NVIDIA H200, 143771 MiB)"
    assert gpu.gpu_problem(1, [], "nvidia-smi not found") == "needs 1 NVIDIA GPU, none visible: nvidia-smi not found"
    assert gpu.gpu_problem(1, one, None) is None


def test_model_problems(tmp_path):
    assert gpu.model_problem(str(tmp_path / "nope")) == f"model {tmp_path / 'nope'}: no such path"
    d = tmp_path / "m"
    d.mkdir()
    assert gpu.model_problem(str(d), "draft model") == f"draft model {d}: no config.json in {d}"
    (d / "config.json").write_text("{}")
    assert gpu.model_problem(str(d)) == f"model {d}: no *.safetensors or *.bin weights in {d}"
    (d / "model.safetensors").write_bytes(b"")
    assert gpu.model_problem(str(d)) is None


def test_hub_id_missing_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", "from kvalign.live.engines.gpu import model_problem; print(model_problem('Qwen/Qwen3-8B'))"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.stdout.strip() == f"model Qwen/Qwen3-8B: not in the local Hugging Face cache ({tmp_path}); download it first"


def test_check_prereqs_on_this_machine_names_what_is_missing():
    """On a CPU-only machine the reasons must include the GPU count; on a GPU box, whatever is absent."""
    pre = gpu.check_prereqs(2, "/nonexistent/model", "/nonexistent/draft", import_check=False)
    assert "model /nonexistent/model: no such path" in pre.problems
    assert "draft model /nonexistent/draft: no such path" in pre.problems
    if len(pre.gpus) < 2:
        assert any(p.startswith("needs 2 NVIDIA GPUs") for p in pre.problems)
    assert pre.skip_reason == "; ".join(pre.problems)


@pytest.mark.slow  # imports dynamo.sglang and SGLang's server stack in a child
def test_dynamo_sglang_import_problem_is_one_line():
    why = gpu.dynamo_sglang_problem()
    if why is None:
        pytest.skip("dynamo.sglang imports on this machine")
    assert "\n" not in why and why.startswith(("dynamo.sglang does not import: ", "dynamo.sglang is not installed"))
