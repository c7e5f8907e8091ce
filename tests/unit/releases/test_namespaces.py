"""Old releases run their own code: in a pair's environment every ``dynamo.*`` / ``sglang.*`` module
that ``check`` imports comes from that release's directory (kvalign/releases/namespaces.py).

``dynamo`` is a namespace package, and a pair's environment lists the running environment (Dynamo
1.6.1) after the release directories, so without the pin a subpackage an old release lacks imports
from 1.6.1. The fast tests show that hazard on a made-up release and that the environment's ``.pth``
closes it; the ``slow`` one runs ``check`` in Dynamo 1.0.2's environment (the release the slow
matrix test installs anyway) and the ``matrix`` one in the environment of every release of the
default matrix: each Dynamo release with its shipped SGLang, each default SGLang with the installed
Dynamo.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvalign.releases import release_env
from kvalign.releases.namespaces import foreign, namespace_portions

CHILD = Path(__file__).with_name("origins_child.py")
ROOT = Path(__file__).resolve().parents[3]
#: A check that imports every piece of the path (card, hasher, radix cache, relay + router, HiCache) cheaply.
#: in this process (``--jobs 1``): the child reports the modules its own interpreter imported
CHECK = ["check", "--jobs", "1", "--examples", "2", "--ingest-examples", "1", "--tier-examples", "1", "--page-size", "4"]


def _fake_release(where: Path) -> Path:
    """A Dynamo release directory whose ``dynamo`` namespace lacks ``dynamo.llm`` (1.6.1 has it)."""
    (where / "dynamo" / "only_here").mkdir(parents=True)
    (where / "dynamo" / "only_here" / "__init__.py").write_text("")
    return where


def _import(python: str, module: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = f"import importlib, json; m = importlib.import_module({module!r}); print(json.dumps(m.__file__ or list(m.__path__)))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_without_the_pin_a_subpackage_the_release_lacks_comes_from_the_running_environment(tmp_path):
    """The hazard itself (and the check's negative control): the release directory first on the path,
    then this environment, as an unpinned pair environment has them."""
    release = _fake_release(tmp_path / "ai-dynamo-0.0.1")
    env = {**release_env.child_env(), "PYTHONPATH": str(release)}
    res = _import(sys.executable, "dynamo.llm", env)
    assert res.returncode == 0, res.stderr[-1000:]
    leaked = json.loads(res.stdout)
    assert not leaked.startswith(str(release))  # 1.6.1's dynamo.llm, in a 0.0.1 environment
    # what foreign() reports for such a module, and for the namespace package whose path reaches outside
    mod = type(sys)("dynamo.llm")
    mod.__file__ = leaked
    ns = type(sys)("dynamo")
    ns.__path__ = [str(release / "dynamo"), str(Path(leaked).parents[1])]
    assert foreign({"dynamo.llm": mod, "dynamo": ns}, {"dynamo": release}) == [
        f"dynamo: {Path(leaked).parents[1]}", f"dynamo.llm: {leaked}"]


def test_a_release_environment_pins_the_namespace_to_the_release(tmp_path, monkeypatch):
    monkeypatch.setenv("KVALIGN_WHEEL_CACHE", str(tmp_path / "cache"))
    release = _fake_release(tmp_path / "ai-dynamo-0.0.1")
    assert namespace_portions([release]) == {"dynamo": [str(release / "dynamo")]}
    python = release_env.python_for([release])
    env = release_env.child_env()
    res = _import(python, "dynamo.llm", env)
    assert res.returncode == 1 and "ModuleNotFoundError: No module named 'dynamo.llm'" in res.stderr, res.stdout
    res = _import(python, "dynamo.only_here", env)
    assert res.returncode == 0 and json.loads(res.stdout) == str(release / "dynamo" / "only_here" / "__init__.py")
    res = _import(python, "dynamo", env)
    assert json.loads(res.stdout) == [str(release / "dynamo")]
    # a regular package (with __init__.py) needs no pin: its own path is its directory alone
    (tmp_path / "sglang-0.0.2" / "sglang").mkdir(parents=True)
    (tmp_path / "sglang-0.0.2" / "sglang" / "__init__.py").write_text("")
    assert namespace_portions([tmp_path / "sglang-0.0.2"]) == {}


def _origins(python: str, env: dict[str, str], roots: dict[str, Path]) -> dict:
    """The child's report. A child that ends without one runs once more, as ``matrix`` runs a pair
    whose in-process Dynamo runtime deadlocked: intermittent on old releases under load (the check's
    watchdog ends it after 90 s, its threads' stacks in the runtime log the stderr names); seen here
    on 1.4.0 and 1.4.1 with SGLang 0.5.16, each of which then ran clean alone."""
    argv = [python, str(CHILD), *(f"--root={k}={v}" for k, v in roots.items()), "--", *CHECK]
    for _attempt in (1, 2):
        res = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        if res.returncode == 0 and lines:
            return json.loads(lines[-1])
    tail = " | ".join([ln for ln in res.stderr.splitlines() if ln.strip()][-2:]) or "(no stderr)"
    raise AssertionError(f"the check child exited {res.returncode} twice without its report: {tail}")


def assert_own_code(dynamo: str, sglang: str) -> None:
    """``check`` in the pair's environment imports its release packages from the release directories only."""
    from kvalign.verify.report.matrix import MatrixError, ensure_release, pair_env

    try:
        dirs = {"dynamo": ensure_release("dynamo", dynamo), "sglang": ensure_release("sglang", sglang)}
    except MatrixError as exc:
        pytest.skip(f"ai-dynamo {dynamo} or sglang {sglang} cannot be installed here: {exc}")
    roots = {k: v for k, v in dirs.items() if v is not None}
    assert roots, "the installed pair has no release directory to check"
    python, env = pair_env(dirs["dynamo"], dirs["sglang"], sglang)
    seen = _origins(python, env, roots)
    assert seen["exit"] in (0, 1), seen
    for package in roots:
        assert any(m.startswith(f"{package}.") for m in seen["modules"]), (package, seen["modules"])
    assert seen["foreign"] == [], f"dynamo {dynamo} x sglang {sglang}: modules from outside their release: {seen['foreign']}"


@pytest.mark.slow  # one small check in Dynamo 1.0.2's environment (the release test_matrix.py installs): ~1 min
@pytest.mark.timeout(1800)
def test_dynamo_1_0_2_runs_its_own_code(sglang_available):
    assert_own_code("1.0.2", sglang_available)


def _default_matrix_pairs() -> list[tuple[str, str]]:
    """Each release of the default matrix once: every Dynamo release with its shipped SGLang, and every
    default SGLang with the installed Dynamo."""
    from kvalign.verify.report.matrix import DEFAULT_SGLANG, default_dynamo_versions, installed, shipped_sglang

    pairs = [(d, s) for d in default_dynamo_versions() if (s := shipped_sglang(d))]
    return pairs + [(installed("ai-dynamo-runtime"), s) for s in DEFAULT_SGLANG if s != installed("sglang")]


@pytest.mark.matrix
@pytest.mark.nightly
@pytest.mark.timeout(14400)
def test_every_release_of_the_default_matrix_runs_its_own_code(request):
    expr = request.config.getoption("markexpr") or ""
    if not (os.environ.get("KVALIGN_NIGHTLY") or "matrix" in expr or "nightly" in expr):
        pytest.skip("every release of the default matrix: nightly only (select with -m matrix or KVALIGN_NIGHTLY=1)")
    failures = []
    for dynamo, sglang in _default_matrix_pairs():
        try:
            assert_own_code(dynamo, sglang)
        except (AssertionError, pytest.skip.Exception) as exc:  # here a release that will not install fails too
            failures.append(f"dynamo {dynamo} x sglang {sglang}: " + str(exc).splitlines()[0])
    assert not failures, "\n".join(failures)
