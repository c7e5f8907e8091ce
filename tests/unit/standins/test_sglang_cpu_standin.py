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
import standin_child
from standin_child import StandinChildren

from kvalign.standins import sglang_cpu as standin
from kvalign.standins.sglang_cpu import ops

PY = sys.executable
ROOT = Path(__file__).resolve().parents[3]


def _child(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", standin.ENABLE_ENV)}
    return subprocess.run([PY, "-c", code, *args], capture_output=True, text=True, timeout=120, env={**base, **env})


def _section(standin_children: StandinChildren, name: str) -> str:
    """``name``'s stdout (:data:`WORKER_SECTIONS`) in the environment's release's shared child; its traceback fails
    the test."""
    return standin_children.section(standin.SGLANG_VERSION, None, name)


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


#: The slow tests' code, run in ONE child with the stand-in loaded as in a worker: each test used to start its own,
#: and each paid the same imports (torch, the stand-in, SGLang's scheduler and attention modules: about 10 CPU-s
#: apiece). That child is the environment's release's, which the stand-in's test files share (:mod:`standin_child`:
#: HiCache's pool round trips run in it too, after these): the sections run in the order listed, ``sgl_kernel``'s
#: exports first, on a fresh interpreter as before; a patch applies when its module is first imported, whichever
#: section imports it. Each test asserts on its own section's output and fails on its own traceback.
WORKER_SECTIONS: dict[str, str] = {}

WORKER_SECTIONS["exports"] = (
    "import json, sgl_kernel, torch\n"
    "names = sorted(n for n in vars(sgl_kernel) if n.endswith('_cpu'))\n"
    "try:\n    from sgl_kernel import convert_weight_packed\n    missing = False\n"
    "except ImportError:\n    missing = True\n"
    "try:\n    import sgl_kernel.mamba\n    sub = True\n"
    "except ImportError:\n    sub = False\n"
    "ops = [hasattr(torch.ops.sgl_kernel, n) for n in %r]\n"
    "print(json.dumps([names, missing, sub, ops]))\n" % (list(ops.IMPORT_TIME_OPS),)
)


@pytest.mark.slow  # the shared child (standin_children) imports torch and the stand-in
def test_sgl_kernel_exports_exactly_the_covered_names(standin_children):
    from kvalign.standins.sglang_cpu import kernels  # imports torch: here, not at every worker's collection

    names, missing, sub, registered = json.loads(_section(standin_children, "exports"))
    assert names == sorted([*kernels.__all__, *ops.UNCOVERED_FUNCTIONS])
    assert missing, "convert_weight_packed must stay absent (keeps SGLang's AMX path off)"
    assert not sub, "submodules such as sgl_kernel.mamba must raise ImportError"
    assert all(registered)


@pytest.mark.parametrize("name", ops.UNCOVERED_FUNCTIONS)
def test_uncovered_functions_raise_with_the_reason(name):
    with pytest.raises(NotImplementedError, match=f"sgl_kernel.{name} is not covered"):
        ops.uncovered_functions()[name]()


WORKER_SECTIONS["patches"] = (
    "import inspect\n"
    "from sglang.srt.speculative import draft_utils\n"
    "from sglang.srt.layers.attention import torch_native_backend as t\n"
    "from sglang.srt.arg_groups import pd_disaggregation_hook as h\n"
    "from sglang.srt.managers import disagg_service as d\n"
    "from sglang.srt.disaggregation import decode, utils\n"
    "from sglang.srt.disaggregation.utils import KVClassType, TransferBackend\n"
    "mods = [draft_utils.DraftBackendFactory._create_backend, t.TorchNativeAttnBackend.forward_extend,\n"
    "        h.handle_pd_disaggregation, d.get_kv_class, decode._is_fake_transfer, utils._is_fake_transfer]\n"
    "print(all(f.__code__.co_filename.endswith('standins/sglang_cpu/patches.py') for f in mods),\n"
    "      d.get_kv_class(TransferBackend.FAKE, KVClassType.BOOTSTRAP_SERVER).__name__)\n"
)


@pytest.mark.slow  # the shared child (standin_children) imports SGLang's scheduler, attention and disaggregation modules
def test_patches_find_their_targets_in_the_installed_sglang(standin_children):
    """Each patch checks the code it changes still looks as in 0.5.23 and applies: run them all in a
    child with the stand-in on (importing the patched modules triggers them) and check the effect."""
    assert _section(standin_children, "patches").split() == ["True", "NoBootstrapServer"]


WORKER_SECTIONS["dp_padding"] = (
    "from sglang.srt.layers.attention import torch_native_backend as t\n"
    "from sglang.srt.layers.attention.intel_amx_backend import IntelAMXAttnBackend as A\n"
    "print(t.TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value(None), "
    "A.get_cpu_graph_seq_len_fill_value(None))\n"
)


@pytest.mark.slow  # the shared child (standin_children) imports SGLang's attention backends
def test_torch_native_pads_a_dp_attention_batch_as_sglangs_own_cpu_backend(standin_children):
    """DP attention pads every batch for its MLP sync and asks the attention backend for the padded
    sequences' length; the stand-in's answer on torch_native is SGLang's own CPU backend's."""
    ours, sglangs = _section(standin_children, "dp_padding").split()
    assert ours == sglangs == "1"
    # SGLang's own torch_native lacks it: read in this process, which never has the stand-in
    # (test_stand_in_is_absent_from_processes_that_did_not_ask_for_it), with the oracles' torchvision shim alone
    from kvalign.oracles.sglang import _modules

    _modules()
    from sglang.srt.layers.attention import torch_native_backend as t

    assert str(standin.SITE_DIR) not in sys.path and not os.environ.get(standin.ENABLE_ENV)
    assert not hasattr(t.TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value")


WORKER_SECTIONS["idle_rotation"] = (
    "import torch\nfrom sglang.srt.layers.rotary_embedding.base import RotaryEmbedding as R\n"
    "r = R(16, 16, 2048, 10000, True, torch.float32)\n"
    "q, k = r.forward_native(torch.zeros(0, dtype=torch.long), torch.zeros(0, 64), torch.zeros(0, 32))\n"
    "g = torch.Generator().manual_seed(0)\n"
    "p, q1, k1 = torch.arange(3), torch.randn(3, 64, generator=g), torch.randn(3, 32, generator=g)\n"
    "a, b = r.forward_native(p, q1.clone(), k1.clone())\n"
    "c, d = R.forward_native.__wrapped__(r, p, q1.clone(), k1.clone())\n"
    "try:\n    R.forward_native.__wrapped__(r, torch.zeros(0, dtype=torch.long), torch.zeros(0, 64), torch.zeros(0, 32))\n"
    "    raised = False\nexcept RuntimeError:\n    raised = True\n"
    "print(tuple(q.shape) == (0, 64) and tuple(k.shape) == (0, 32), torch.equal(a, c) and torch.equal(b, d), raised)\n"
)


@pytest.mark.slow  # the shared child (standin_children) imports SGLang's rotary embedding with the stand-in
def test_an_idle_dp_attention_rank_rotates_its_empty_batch_and_others_go_to_sglang(standin_children):
    """A rank with no requests runs its idle forward with zero tokens: the stand-in returns it as it
    came (SGLang's own native path raises on it); a batch with tokens gets SGLang's own rotation."""
    assert _section(standin_children, "idle_rotation").split() == ["True", "True", "True"]


for _name, _code in WORKER_SECTIONS.items():
    standin_child.add(_name, _code, [standin.SGLANG_VERSION], imports_first=True)
