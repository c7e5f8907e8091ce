"""kvalign's SGLang CPU stand-in: pinned, loaded only where asked, and exporting only what it covers.

The kernels themselves are held against SGLang's Triton kernels in
``test_sglang_cpu_standin_kernels.py``; the patches run for real in the e2e real-engine tests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from kvalign.standins import sglang_cpu as standin
from kvalign.standins.sglang_cpu import kernels, ops

PY = sys.executable
ROOT = Path(__file__).resolve().parents[3]


def _child(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", standin.ENABLE_ENV)}
    return subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, env={**base, **env})


def test_pinned_version_matches_the_installed_sglang():
    assert standin.version_problem() is None
    assert metadata.version("sglang") == standin.SGLANG_VERSION


def test_another_sglang_version_is_refused_with_one_clear_line(monkeypatch):
    monkeypatch.setattr(standin.metadata, "version", lambda _name: "0.5.17")
    problem = standin.version_problem()
    assert problem == ("kvalign's SGLang CPU stand-in supports sglang 0.5.19, 0.5.21, 0.5.23, not sglang 0.5.17: "
                       "the real-engine CPU workers need one of those")
    assert standin.version_problem("0.5.21") is None and standin.version_problem("0.5.18") is not None


def test_a_worker_with_another_sglang_stops_at_start_up(tmp_path):
    """The check runs in the worker's own sitecustomize: a fake dist-info for sglang 9.9.9 placed
    first on the path makes ``metadata.version`` report it, and the process exits 2 at start."""
    dist = tmp_path / "sglang-9.9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 9.9.9\n")
    # the repo root after it: the worker's kvalign is this checkout's, also from a git worktree
    proc = _child("print('started')", **standin.worker_env(os.pathsep.join([str(tmp_path), str(ROOT)])))
    assert proc.returncode == 2 and "started" not in proc.stdout
    assert proc.stderr.strip().splitlines() == [
        "kvalign: kvalign's SGLang CPU stand-in supports sglang 0.5.19, 0.5.21, 0.5.23, not sglang 9.9.9: "
        "the real-engine CPU workers need one of those"]


def test_stand_in_is_absent_from_processes_that_did_not_ask_for_it():
    """Never leaks: the test process (and so every oracle) has no sgl_kernel and no patches."""
    assert str(standin.SITE_DIR) not in sys.path
    proc = _child("import importlib.util, sys; import kvalign.oracles.sglang, kvalign.oracles.dynamo; "
                  "print(importlib.util.find_spec('sgl_kernel') is None, 'kvalign.standins.sglang_cpu' in sys.modules)")
    assert proc.stdout.split() == ["True", "False"], proc.stderr


@pytest.mark.slow  # a child process that imports torch and the stand-in
def test_sgl_kernel_exports_exactly_the_covered_names():
    code = (
        "import json, sgl_kernel, torch\n"
        "names = sorted(n for n in vars(sgl_kernel) if n.endswith('_cpu'))\n"
        "try:\n    from sgl_kernel import convert_weight_packed\n    missing = False\n"
        "except ImportError:\n    missing = True\n"
        "try:\n    import sgl_kernel.mamba\n    sub = True\n"
        "except ImportError:\n    sub = False\n"
        "ops = [hasattr(torch.ops.sgl_kernel, n) for n in %r]\n"
        "print(json.dumps([names, missing, sub, ops]))\n" % (list(ops.IMPORT_TIME_OPS),)
    )
    proc = _child(code, **standin.worker_env())
    assert proc.returncode == 0, proc.stderr
    names, missing, sub, registered = json.loads(proc.stdout)
    assert names == sorted([*kernels.__all__, *ops.UNCOVERED_FUNCTIONS])
    assert missing, "convert_weight_packed must stay absent (keeps SGLang's AMX path off)"
    assert not sub, "submodules such as sgl_kernel.mamba must raise ImportError"
    assert all(registered)


@pytest.mark.parametrize("name", ops.UNCOVERED_FUNCTIONS)
def test_uncovered_functions_raise_with_the_reason(name):
    with pytest.raises(NotImplementedError, match=f"sgl_kernel.{name} is not covered"):
        ops.uncovered_functions()[name]()


@pytest.mark.slow  # a child process that imports SGLang's scheduler, attention and disaggregation modules
def test_patches_find_their_targets_in_the_installed_sglang():
    """Each patch checks the code it changes still looks as in 0.5.23 and applies: run them all in a
    child with the stand-in on (importing the patched modules triggers them) and check the effect."""
    code = (
        "import inspect\n"
        "from sglang.srt.speculative import draft_utils\n"
        "from sglang.srt.layers.attention import torch_native_backend as t\n"
        "from sglang.srt.arg_groups import pd_disaggregation_hook as h\n"
        "from sglang.srt.managers import disagg_service as d\n"
        "from sglang.srt.disaggregation import decode, utils\n"
        "from sglang.srt.disaggregation.utils import KVClassType, TransferBackend\n"
        "mods = [draft_utils.DraftBackendFactory._create_backend, t.TorchNativeAttnBackend.forward_extend,\n"
        "        h.handle_pd_disaggregation, d.get_kv_class, decode._is_fake_transfer, utils._is_fake_transfer]\n"
        "print(all(f.__code__.co_filename.endswith('sglang_cpu_standin/patches.py') for f in mods),\n"
        "      d.get_kv_class(TransferBackend.FAKE, KVClassType.BOOTSTRAP_SERVER).__name__)\n"
    )
    proc = _child(code, **standin.worker_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "NoBootstrapServer"]


@pytest.mark.slow  # a child that imports SGLang's attention backends with the stand-in
def test_torch_native_pads_a_dp_attention_batch_as_sglangs_own_cpu_backend():
    """DP attention pads every batch for its MLP sync and asks the attention backend for the padded
    sequences' length; the stand-in's answer on torch_native is SGLang's own CPU backend's."""
    code = ("from sglang.srt.layers.attention import torch_native_backend as t\n"
            "from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend as A\n"
            "print(t.TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value(None), "
            "A.get_cpu_graph_seq_len_fill_value(None))\n")
    proc = _child(code, **standin.worker_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours, sglangs = proc.stdout.split()
    assert ours == sglangs == "1"
    plain = _child("from kvalign.oracles.sglang import _modules; _modules()\n"  # the torchvision shim alone
                   "from sglang.srt.layers.attention import torch_native_backend as t\n"
                   "print(hasattr(t.TorchNativeAttnBackend, 'get_cpu_graph_seq_len_fill_value'))\n")
    assert plain.returncode == 0 and plain.stdout.split() == ["False"]  # SGLang's own torch_native lacks it
