"""kvalign.releases.release_env: a release's environment and the installer that fills its directory.

The environment is checked from inside its own interpreter (what a pair's check sees), with a
release directory made on the spot; the installers are checked against each other on a real,
small wheel from the package index: uv and pip must fill a ``--target`` directory with the same
importable files, since a cache filled by one is read by the other.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvalign.releases import release_env
from kvalign.releases.release_env import ReleaseEnvError, installer, install, python_for

#: torch is found, not imported (importing it is 2-3 CPU-s): ``find_spec`` resolves it on the same ``sys.path``,
#: so its origin is the ``torch.__file__`` an import would give
PROBE = """
import importlib.metadata as md, importlib.util, json, sys, kvalign
print(json.dumps({"path": sys.path, "version": md.version("ai-dynamo-runtime"), "kvalign": kvalign.__file__,
                  "mod": __import__("kvalign_probe_release").WHERE, "torch": importlib.util.find_spec("torch").origin}))
"""


def _release(where: Path, version: str) -> Path:
    """A release directory as the installer leaves one: a module and its dist-info."""
    where.mkdir(parents=True)
    (where / "kvalign_probe_release.py").write_text(f"WHERE = {str(where)!r}\n")
    meta = where / f"ai_dynamo_runtime-{version}.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: ai-dynamo-runtime\nVersion: {version}\n")
    return where


def _probe(python: str, **env: str) -> dict:
    res = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120,
                         env=release_env.child_env({**os.environ, **env}))
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout)


def test_a_release_environment_sees_its_release_first_then_kvalign_then_the_base(tmp_path, monkeypatch):
    monkeypatch.setenv("KVALIGN_WHEEL_CACHE", str(tmp_path / "cache"))
    release = _release(tmp_path / "ai-dynamo-0.0.1", "0.0.1")
    python = python_for([release])
    seen = _probe(python)
    # the release's metadata wins over the installed ai-dynamo-runtime; its module is importable
    assert seen["version"] == "0.0.1" and seen["mod"] == str(release)
    assert seen["kvalign"].startswith(str(release_env.ROOT))  # this checkout's kvalign
    assert seen["torch"].startswith(tuple(release_env.base_site_dirs()))  # the base's torch
    path = seen["path"]
    assert path.index(str(release)) < path.index(str(release_env.ROOT)) < path.index(release_env.base_site_dirs()[0])
    assert python_for([release]) == python  # built once per combination
    assert python_for([release, _release(tmp_path / "sglang-0.0.2", "0.0.2")]) != python


def test_the_installed_release_is_used_when_no_directory_is_given(tmp_path, monkeypatch):
    """The negative control: the base environment's interpreter reports the installed runtime."""
    monkeypatch.setenv("KVALIGN_WHEEL_CACHE", str(tmp_path / "cache"))
    seen = subprocess.run([python_for([]), "-c", "import importlib.metadata as md; print(md.version('ai-dynamo-runtime'))"],
                          capture_output=True, text=True, timeout=120, env=release_env.child_env())
    import importlib.metadata as md

    assert seen.stdout.strip() == md.version("ai-dynamo-runtime") != "0.0.1"


def test_an_unknown_installer_is_one_error_line(monkeypatch):
    monkeypatch.setenv("KVALIGN_INSTALLER", "conda")
    with pytest.raises(ReleaseEnvError, match="KVALIGN_INSTALLER='conda': expected one of uv, pip"):
        installer()


def test_uv_is_the_default_installer_where_it_is_installed(monkeypatch):
    monkeypatch.delenv("KVALIGN_INSTALLER", raising=False)
    assert release_env.uv_binary() is not None, "uv is a kvalign dependency"
    assert installer() == "uv"
    monkeypatch.setenv("KVALIGN_INSTALLER", "pip")
    assert installer() == "pip" and release_env.install_command(Path("/t"), ["x==1"])[1:4] == ["-m", "pip", "install"]


@pytest.mark.slow  # two installs of a small wheel from the package index
def test_uv_and_pip_fill_a_target_directory_with_the_same_files(tmp_path, monkeypatch):
    trees = {}
    for tool in ("uv", "pip"):
        monkeypatch.setenv("KVALIGN_INSTALLER", tool)
        target = tmp_path / tool
        try:
            install(target, ["six==1.16.0"])
        except ReleaseEnvError as exc:
            pytest.skip(f"the package index cannot be reached: {exc}")
        trees[tool] = {p.relative_to(target).as_posix() for p in target.rglob("*")
                       if p.is_file() and "__pycache__" not in p.parts
                       and p.name not in ("RECORD", "INSTALLER", "REQUESTED", ".lock")}  # each tool's own bookkeeping
    assert trees["uv"] == trees["pip"] and "six.py" in trees["uv"]


def test_a_failed_install_is_one_error_line_naming_the_requirement(tmp_path, monkeypatch):
    monkeypatch.setenv("KVALIGN_INSTALLER", "uv")
    with pytest.raises(ReleaseEnvError, match=r"cannot install kvalign-no-such-package==9\.9\.9: ") as err:
        install(tmp_path / "t", ["kvalign-no-such-package==9.9.9"])
    assert "\n" not in str(err.value)
