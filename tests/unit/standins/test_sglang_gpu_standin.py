"""The GPU stand-in against SGLang 0.5.23's own sources (installed here, importable up to ``cutlass``).

``sglang.kernels.ops.gemm.cutedsl_dual_gemm`` cannot be imported without nvidia-cutlass-dsl, on this
machine as on the GPU machine, so it is read as source: the stand-in must expose the same names with
the same values and signature, and the original must answer False on Hopper before anything else
(its shape contract starts with ``is_sm100_supported()``), which is the answer the stand-in gives.
The hooks are run in a child process, where importing SGLang's module must give the stand-in with
them and fail without them (the reason they exist).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvalign.standins import sglang_gpu
from kvalign.standins.sglang_gpu import cutedsl_dual_gemm as standin

ORIGINAL = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"


def original_source() -> ast.Module:
    """SGLang's module as installed (found without importing SGLang's kernel packages)."""
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    return ast.parse((root / "kernels" / "ops" / "gemm" / "cutedsl_dual_gemm.py").read_text())


def surface(tree: ast.Module) -> dict[str, object]:
    """The names callers import: the enum's members, the token cap, the predicate's parameters."""
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "DualGemmQuantMode":
            out["enum"] = {t.targets[0].id: ast.literal_eval(t.value) for t in node.body if isinstance(t, ast.Assign)}
            out["properties"] = sorted(f.name for f in node.body if isinstance(f, ast.FunctionDef))
        elif isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "MAX_DUAL_GEMM_DECODE_TOKENS":
            out["max_tokens"] = ast.literal_eval(node.value)
        elif isinstance(node, ast.FunctionDef) and node.name == "can_use_dual_gemm":
            out["params"] = [a.arg for a in node.args.args]
    return out


def standin_surface() -> dict[str, object]:
    return surface(ast.parse(Path(standin.__file__).read_text()))


def test_stand_in_exposes_the_originals_names_values_and_signature():
    assert sglang_gpu.version_problem(kernel=sglang_gpu.SGLANG_KERNEL_VERSION) is None  # the pinned release is here
    assert standin_surface() == surface(original_source())


def test_a_stand_in_with_another_enum_value_is_caught():
    """Negative control: the comparison sees a drifted stand-in."""
    drifted = ast.parse(Path(standin.__file__).read_text().replace("UNQUANT = 4", "UNQUANT = 5"))
    assert surface(drifted) != surface(original_source())


def test_the_original_refuses_the_dual_gemm_off_sm100_before_any_shape_check():
    func = next(n for n in original_source().body if isinstance(n, ast.FunctionDef) and n.name == "can_use_dual_gemm")
    first = func.body[1] if isinstance(func.body[0], ast.Expr) else func.body[0]  # after the docstring
    conjuncts = ast.unparse(first.value).split(" and ")
    assert "is_sm100_supported()" in conjuncts and "if not shape_supported" in ast.unparse(func.body[2])


def test_stand_in_answers_false_off_sm100_and_refuses_on_sm100(monkeypatch):
    from kvalign.standins.sglang_cpu.hooks import TORCHVISION_SHIM

    for name in TORCHVISION_SHIM:  # PyPI's torchvision is a CUDA build (the CPU stand-in's shim)
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    import sglang.srt.utils as utils

    monkeypatch.setattr(utils, "is_sm100_supported", lambda *a, **k: False)
    assert standin.can_use_dual_gemm(1, 128, 128, standin.DualGemmQuantMode.UNQUANT) is False
    monkeypatch.setattr(utils, "is_sm100_supported", lambda *a, **k: True)
    with pytest.raises(RuntimeError, match="Hopper only"):
        standin.can_use_dual_gemm(1, 128, 128, standin.DualGemmQuantMode.UNQUANT)
    assert list(inspect.signature(standin.can_use_dual_gemm).parameters) == surface(original_source())["params"]


#: In one fresh process: SGLang's module imported with the stand-in's finder first (and the CPU environment's
#: torchvision shim: PyPI's torchvision is a CUDA build, :mod:`.sglang_cpu.hooks`), then, the finder and what it
#: served removed, imported again without it; the last line is ``{"served": file, "without": traceback or None}``.
#: One child for both (two used to start, each importing SGLang's kernel packages: about 8 CPU-s apiece): the
#: served import still runs on a fresh interpreter, and the original then fails on its own imports as before.
_IMPORT_CHILD = (
    "import importlib, json, sys, traceback, types\n"
    "from kvalign.standins.sglang_gpu import hooks\n"
    "from kvalign.standins.sglang_cpu.hooks import TORCHVISION_SHIM\n"
    "[sys.modules.setdefault(n, types.ModuleType(n)) for n in TORCHVISION_SHIM]\n"
    "sys.meta_path[:0] = [hooks.Replace()]\n"
    f"served = importlib.import_module({ORIGINAL!r}).__file__\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, hooks.Replace)]\n"
    f"parent, _, name = {ORIGINAL!r}.rpartition('.')\n"
    f"del sys.modules[{ORIGINAL!r}]\n"
    "delattr(sys.modules[parent], name)\n"
    "try:\n"
    f"    importlib.import_module({ORIGINAL!r})\n"
    "    without = None\n"
    "except BaseException:\n"
    "    without = traceback.format_exc()\n"
    "print(json.dumps({'served': served, 'without': without}))\n"
)


@pytest.mark.slow  # a child importing SGLang's kernel packages (about 8 s)
def test_hooks_serve_the_stand_in_where_sglangs_module_cannot_import():
    proc = subprocess.run([sys.executable, "-c", _IMPORT_CHILD], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    without = out["without"]
    # why the stand-in exists: the original imports cuda-python's driver bindings, then cutlass
    assert without is not None and "ModuleNotFoundError: No module named 'cu" in without, without
    assert out["served"] == standin.__file__


def test_version_pin_names_what_differs():
    assert "sglang-kernel 0.4.10" in sglang_gpu.version_problem(sglang="0.5.23", kernel="0.4.10")
    assert "not sglang 0.5.21" in sglang_gpu.version_problem(sglang="0.5.21", kernel="0.4.5")
    env = sglang_gpu.worker_env("/x")
    assert env["PYTHONPATH"] == f"{sglang_gpu.SITE_DIR}:/x" and env[sglang_gpu.ENABLE_ENV] == "1"
    assert env["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] == "python" and env["SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"] == "1"


def _flash_mla_imports() -> dict[str, set[str]]:
    """What SGLang 0.5.23's ``flash_mla_interface`` takes from ``flash_mla`` at import: module -> names
    (read from SGLang's source: the module that imports the package, not imported itself)."""
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    tree = ast.parse((root / "kernels" / "ops" / "attention" / "flash_mla_interface.py").read_text())
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "flash_mla":
            out.setdefault(node.module, set()).update(a.name for a in node.names)
        elif isinstance(node, ast.Import) and any(a.name == "flash_mla" for a in node.names):
            out.setdefault("flash_mla", set())
    return out


def test_the_flash_mla_placeholder_has_every_name_sglang_imports_and_each_raises():
    """The placeholder stands in only at import (SGLang's EAGLE worker imports FlashMLA's backend while
    capturing CUDA graphs); every name SGLang's module takes exists, and calling one raises."""
    site = Path(sglang_gpu.__file__).resolve().parent / "site"
    wanted = _flash_mla_imports()
    assert wanted == {"flash_mla": {"fused_norm_rope_attn_rope_cast"},
                      "flash_mla.flash_mla_interface": {"FlashMLASchedMeta"}}, wanted
    for module, names in wanted.items():
        path = site.joinpath(*module.split(".")).with_suffix(".py")
        if not path.exists():
            path = site.joinpath(*module.split("."), "__init__.py")
        spec = importlib.util.spec_from_file_location(f"placeholder_{module.replace('.', '_')}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for name in names:
            with pytest.raises(NotImplementedError, match="placeholder"):
                getattr(mod, name)()
