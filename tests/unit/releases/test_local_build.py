"""kvalign.releases.local_build: a pull request's own build checked like a release (``matrix --dynamo PATH``).

The differential test builds a source checkout from the installed ai-dynamo 1.6.1 (its own files,
nothing changed) and expects the release's row; a copy whose ``dynamo.sglang`` derives
``enable_eagle`` from the hand-kept name set of Dynamo #10982 must give a misaligned row naming
``ROUTER_EAGLE_OFF`` and #10982 (the card says enable_eagle=False for EAGLE3, where SGLang keys bigrams).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from kvalign.releases import local_build
from kvalign.cli import main
from kvalign.errors import UsageError


def _wheel(path: Path, files: dict[str, bytes], dist: str = "ai_dynamo", version: str = "1.6.1",
           date: tuple = (2020, 1, 1, 0, 0, 0)) -> Path:
    whl = path / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        for name, data in {**files, f"{dist}-{version}.dist-info/METADATA":
                           f"Name: {dist}\nVersion: {version}\nRequires-Dist: ai-dynamo-runtime==1.6.0\n".encode()}.items():
            zf.writestr(zipfile.ZipInfo(name, date), data)
    return whl


def test_label_is_the_content_not_the_zip_timestamps(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    one = local_build.resolve("dynamo", str(_wheel(tmp_path / "a", {"dynamo/x.py": b"1"})), tmp_path)
    again = local_build.resolve("dynamo", str(_wheel(tmp_path / "b", {"dynamo/x.py": b"1"}, date=(2024, 5, 5, 1, 2, 4))),
                                tmp_path)
    other = local_build.resolve("dynamo", str(_wheel(tmp_path / "c", {"dynamo/x.py": b"2"})), tmp_path)
    assert one.label == again.label and one.label.startswith("1.6.1+local.") and other.label != one.label
    assert local_build.find("dynamo", one.label) is not None and local_build.find("sglang", one.label) is None
    # an ai-dynamo build brings the runtime its METADATA pins, not its own version's
    assert local_build.requirements(one) == [str(one.wheel), "ai-dynamo-runtime==1.6.0"]


@pytest.mark.parametrize("argv, says", [
    (["--dynamo", "./no/such/checkout"], "--dynamo ./no/such/checkout: no such wheel file or source checkout"),
    (["--sglang", "{wheel}"], "a wheel of ai-dynamo, not of sglang"),
    (["--dynamo", "{junk}"], "not a wheel"),
])
def test_bad_local_builds_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, argv, says):
    monkeypatch.setenv("KVALIGN_WHEEL_CACHE", str(tmp_path / "cache"))
    wheel = _wheel(tmp_path, {"dynamo/x.py": b"1"})
    junk = tmp_path / "junk-1.0-py3-none-any.whl"
    junk.write_bytes(b"not a zip")
    argv = [a.format(wheel=wheel, junk=junk) for a in argv]
    other = ["--sglang", "0.5.23"] if argv[0] == "--dynamo" else ["--dynamo", "1.6.1"]
    rc = main(["matrix", *argv, *other, "--list-cells"])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err and says in err, err


def test_a_local_item_that_is_no_version_is_refused():
    with pytest.raises(UsageError):
        local_build.resolve("sglang", "/nonexistent/sglang.whl", Path("/tmp"))


def _checkout(dest: Path, *, broken: bool) -> Path:
    """A source checkout of the installed ai-dynamo: its own files and a pyproject that builds them."""
    dist = md.distribution("ai-dynamo")
    for f in dist.files or []:
        if f.parts[0] == "dynamo" and "__pycache__" not in f.parts:
            out = dest / f
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f.locate(), out)
    if broken:  # Dynamo #10982: enable_eagle from a hand-kept name set, so EAGLE3 registers eagle off
        reg = dest / "dynamo" / "sglang" / "register.py"
        src = reg.read_text()
        fixed = "return SpeculativeAlgorithm.from_string(speculative_algorithm).is_eagle()"
        assert fixed in src, "ai-dynamo's register.py moved: update the #10982 copy"
        reg.write_text(src.replace(fixed, 'return speculative_algorithm in ("EAGLE", "NEXTN")'))
    (dest / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=64"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "ai-dynamo"\nversion = "{dist.version}"\n'
        f'dependencies = ["ai-dynamo-runtime=={dist.version}"]\n'
        '[tool.setuptools.packages.find]\ninclude = ["dynamo*"]\nnamespaces = true\n'
        '[tool.setuptools.package-data]\n"*" = ["*"]\n')
    return dest


def _matrix_row(dynamo: str, tmp_path: Path) -> dict:
    """The row of ``matrix --json`` for ``dynamo`` x the installed SGLang, with the options of the installed
    pair's cell (tests/unit/installed_cell.py: card and hash, and why those two)."""
    from installed_cell import matrix, options

    res = matrix(*options(dynamo, md.version("sglang")), "--json", cwd=tmp_path, timeout=1500)
    assert res.returncode in (0, 1), res.stderr[-3000:]
    [row] = json.loads(res.stdout.splitlines()[-1])["rows"]
    return row


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_pull_requests_build_gets_the_release_row_and_a_broken_one_does_not(tmp_path, installed_cell):
    # the release's row: the installed pair's cell, which test_matrix_cells.py merges into its run's table
    assert installed_cell.cell == f"{md.version('ai-dynamo')}:{md.version('sglang')}"
    assert installed_cell.returncode in (0, 1), installed_cell.stderr[-3000:]
    [release] = installed_cell.document["rows"]
    same = _matrix_row(str(_checkout(tmp_path / "same", broken=False)), tmp_path)
    assert same["dynamo"].startswith(md.version("ai-dynamo") + "+local.")
    keys = [[(f["property"], f["mode"], f["variant"], f["cause"]) for f in r["findings"]] for r in (same, release)]
    assert same["verdict"] == release["verdict"] and keys[0] == keys[1], (same, release)
    broken = _matrix_row(str(_checkout(tmp_path / "broken", broken=True)), tmp_path)
    assert broken["verdict"] == "misaligned", broken
    assert any(f["cause"] == "ROUTER_EAGLE_OFF" and f["property"] == "card" and "#10982" in f["detail"]
               for f in broken["findings"]), broken
