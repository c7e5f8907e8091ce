"""The GPU bundle's committed manifest (``scripts/gpu/manifest.json``) against its pins and its limits.

The bundle is built by ``scripts/gpu/pack.py`` and carried to the GPU machine a chunk per command; a
chunk that, with the working tree, passes one command's 64 MiB carry is refused there, so the limit is
held here, in the fast tier, on the committed manifest and on the placement that produced it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

ROOT = Path(__file__).resolve().parents[3]
SPEC = importlib.util.spec_from_file_location("kvalign_gpu_pack", ROOT / "scripts" / "gpu" / "pack.py")
pack = sys.modules[SPEC.name] = importlib.util.module_from_spec(SPEC)  # dataclasses look their module up
SPEC.loader.exec_module(pack)

MANIFEST = json.loads(pack.MANIFEST.read_text())


def working_tree_bytes() -> int:
    """What travels with every command besides the carried chunk: the files git tracks."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def test_every_pin_is_in_the_manifest_at_its_version_and_nothing_else():
    pins = pack.read_requirements()
    listed = {d["name"]: d["version"] for d in MANIFEST["distributions"]}
    assert listed == pins
    assert MANIFEST["python"] == pack.PYTHON_VERSION
    assert {"sglang": "0.5.23", "sglang-kernel": "0.4.5", "ai-dynamo": "1.6.1", "ai-dynamo-runtime": "1.6.1",
            "nixl": "1.5.1", "nixl-cu13": "1.5.1"}.items() <= listed.items()


def test_nixl_travels_for_cuda_13_only_and_without_its_torch_2_12_plus_ep_modules():
    """The meta package ``nixl`` picks ``nixl_cu13`` from torch's CUDA 13; its cu12 half (the CPU
    environment's) would be a second ~60 MB the GPU never loads, and NIXL EP is built for torch 2.12+."""
    pins = pack.read_requirements()
    assert "nixl-cu12" not in pins
    assert pack.TRIMS["nixl-cu13"].drop_prefixes == ("nixl_ep_cu13/",)
    entry = next(d for d in MANIFEST["distributions"] if d["name"] == "nixl-cu13")
    assert entry["trim"] == pack.TRIMS["nixl-cu13"].why
    assert entry["archive_bytes"] <= pack.CHUNK_LIMIT


def test_every_stage_the_gpu_docs_run_is_a_stage_of_run_sh():
    """docs/gpu/README.md's ``run.sh STAGE:SECONDS`` lines and each table row's command name stages
    that ``scripts/gpu/run.sh`` knows (an unknown stage stops the whole command there: device time lost)."""
    import re

    run_sh = (ROOT / "scripts" / "gpu" / "run.sh").read_text()
    known = set(re.findall(r"^    ([a-z0-9-]+)\) ", run_sh, re.M))
    assert {"scenario", "nixl-scenario", "nixl-fake", "nixl-injector", "nixl-graphs", "fuzz-disagg-nixl"} <= known
    docs = (ROOT / "docs" / "gpu" / "README.md").read_text()
    named = {m.split(":")[0] for line in re.findall(r"run\.sh ((?:[a-z0-9-]+:\d+ ?)+)", docs) for m in line.split()}
    assert named and named <= known, sorted(named - known)


def test_each_chunk_with_the_working_tree_fits_one_command():
    if not (ROOT / ".git").exists():  # bench/bench_fast_tier.py --against REF runs a `git archive` export
        pytest.skip("not a git checkout: the working tree's size is what git tracks")
    tree = working_tree_bytes()
    assert tree <= pack.TREE_ROOM, f"the working tree ({tree / pack.MIB:.1f} MiB) outgrew the room kept for it"
    for chunk in MANIFEST["chunks"]:
        assert chunk["bytes"] <= MANIFEST["chunk_limit"] == pack.CHUNK_LIMIT, chunk["name"]
        assert chunk["bytes"] + tree <= pack.CALL_LIMIT, chunk["name"]


def test_chunks_hold_exactly_the_archives_that_name_them():
    by_chunk: dict[str, set[str]] = {}
    for entry in [*MANIFEST["distributions"], *MANIFEST["debs"]]:
        by_chunk.setdefault(entry["chunk"], set()).add(entry.get("archive", entry.get("file")))
    sizes = {d["archive"]: d["archive_bytes"] for d in MANIFEST["distributions"]}
    sizes |= {d["file"]: d["bytes"] for d in MANIFEST["debs"]}
    assert {c["name"]: set(c["files"]) for c in MANIFEST["chunks"]} == by_chunk
    for chunk in MANIFEST["chunks"]:
        assert chunk["bytes"] == sum(sizes[f] for f in chunk["files"])


def test_requirements_refuse_an_unpinned_line(tmp_path):
    bad = tmp_path / "req.txt"
    bad.write_text("sglang==0.5.23\nfastapi\n")
    with pytest.raises(SystemExit, match="pins one version"):
        pack.read_requirements(bad)


@given(st.dictionaries(st.text("abc", min_size=1, max_size=4), st.integers(1, 100), min_size=1, max_size=30),
       st.integers(100, 250))
def test_placement_puts_every_archive_once_and_no_chunk_over_the_limit(sizes, limit):
    chunks = pack.place(sizes, limit)
    assert sorted(n for c in chunks for n in c) == sorted(sizes)
    assert all(sum(sizes[n] for n in c) <= limit for c in chunks)


def test_placement_refuses_an_archive_larger_than_a_chunk():
    """Negative control: nothing can carry it, so the build stops instead of writing a chunk that fails there."""
    with pytest.raises(SystemExit, match="over one chunk"):
        pack.place({"small": 10, "huge": 101}, 100)


# ---- reproducible archives: the same wheel, packed from two machines' paths, gives one SHA-256 ----------


def tiny_wheel(where: Path) -> Path:
    """A wheel with a module, an executable data file and a console script (whose installed shebang
    is the installing interpreter's): every kind of file ``pip install`` writes per machine."""
    import base64
    import hashlib
    import zipfile

    files = {
        "tinykv/__init__.py": b"VALUE = 1\n",
        "tinykv/run.sh": b"#!/bin/sh\necho tiny\n",
        "tinykv-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinykv\nVersion: 1.0\n",
        "tinykv-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: kvalign-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        "tinykv-1.0.dist-info/entry_points.txt": b"[console_scripts]\ntinykv = tinykv:VALUE\n",
    }
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for name, data in files.items()) + "tinykv-1.0.dist-info/RECORD,,\n"
    where.mkdir(parents=True, exist_ok=True)
    wheel = where / "tinykv-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in [*files.items(), ("tinykv-1.0.dist-info/RECORD", record.encode())]:
            info = zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if name.endswith(".sh") else 0o644) << 16
            zf.writestr(info, data)
    return wheel


def pack_from(wheel: Path, wheel_dir: Path, out: Path, umask: int) -> dict[str, str]:
    """``pack.stage_and_pack`` of ``wheel`` copied into ``wheel_dir``, under ``umask``: archive -> SHA-256."""
    import os
    import shutil

    wheel_dir.mkdir(parents=True)
    out.mkdir(parents=True)
    old = os.umask(umask)
    try:
        pack.stage_and_pack({"tinykv": Path(shutil.copy(wheel, wheel_dir))}, {"tinykv": "1.0"}, out)
    finally:
        os.umask(old)
    return {p.name: pack.sha256(p) for p in out.iterdir()}


@pytest.mark.slow  # two real `pip install --target` runs (a few seconds)
def test_the_same_wheel_packs_to_one_sha256_from_two_wheel_dirs_and_umasks(tmp_path):
    """Two installs of one wheel from different directories, into different staging trees, under
    different umasks: ``direct_url.json`` would name each wheel path, and ``RECORD`` hash it."""
    wheel = tiny_wheel(tmp_path / "built")
    one = pack_from(wheel, tmp_path / "a" / "wheels", tmp_path / "out-a", 0o022)
    two = pack_from(wheel, tmp_path / "b" / "elsewhere" / "wheels", tmp_path / "out-b", 0o077)
    assert list(one) == ["tinykv.tar.xz"] and one == two


@pytest.mark.slow
def test_without_normalize_the_install_records_leak_the_wheel_path(tmp_path, monkeypatch):
    """Negative control: the same two packs without :func:`pack.normalize` differ (pip's
    ``direct_url.json`` names the wheel's directory), so the test above guards what normalize does."""
    monkeypatch.setattr(pack, "normalize", lambda dist, stage: None)
    wheel = tiny_wheel(tmp_path / "built")
    one = pack_from(wheel, tmp_path / "a" / "wheels", tmp_path / "out-a", 0o022)
    two = pack_from(wheel, tmp_path / "b" / "elsewhere" / "wheels", tmp_path / "out-b", 0o022)
    assert one != two


def staged(stage: Path, wheel_path: str, umask_mode: int) -> "pack.Dist":
    """A staging tree as ``pip install --target`` leaves one distribution (no pip run): the install
    records of this machine, a console script's RECORD line outside the tree, files at ``umask_mode``."""
    info = stage / "tinykv-1.0.dist-info"
    info.mkdir(parents=True)
    (stage / "tinykv").mkdir()
    (stage / "tinykv" / "__init__.py").write_text("VALUE = 1\n")
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: tinykv\nVersion: 1.0\n")
    (info / "INSTALLER").write_text("pip\n")
    (info / "direct_url.json").write_text('{"url": "file://%s"}' % wheel_path)
    (info / "RECORD").write_text(f"../../bin/tinykv,sha256={wheel_path},99\ntinykv/__init__.py,,\n")
    for p in (stage / "tinykv" / "__init__.py", info / "METADATA", info / "INSTALLER", info / "direct_url.json",
              info / "RECORD"):
        p.chmod(umask_mode)
    files = ["tinykv/__init__.py", "tinykv-1.0.dist-info/METADATA", "tinykv-1.0.dist-info/INSTALLER",
             "tinykv-1.0.dist-info/direct_url.json", "tinykv-1.0.dist-info/RECORD"]
    return pack.Dist("tinykv", "1.0", Path(wheel_path), files)


def test_normalize_drops_the_wheel_path_and_writes_record_from_what_travels(tmp_path):
    a, b = staged(tmp_path / "a", "/home/one/wheels/t.whl", 0o644), staged(tmp_path / "b", "/other/w/t.whl", 0o600)
    digests = []
    for dist, stage in ((a, tmp_path / "a"), (b, tmp_path / "b")):
        pack.normalize(dist, stage)
        assert "tinykv-1.0.dist-info/direct_url.json" not in dist.files
        record = (stage / "tinykv-1.0.dist-info" / "RECORD").read_text().splitlines()
        assert [line.split(",")[0] for line in record] == sorted(dist.files)
        assert "tinykv-1.0.dist-info/RECORD,," in record and not any(".." in line for line in record)
        pack.pack(dist.files, stage, tmp_path / f"{stage.name}.tar.xz")
        digests.append(pack.sha256(tmp_path / f"{stage.name}.tar.xz"))
    assert digests[0] == digests[1]


def test_pack_fixes_what_the_staging_machine_leaves_in_a_tar_header(tmp_path):
    """mtime, owner and the umask's mode bits: a file at 0600 and one at 0644 pack alike; an
    executable stays executable."""
    import os
    import tarfile

    for name, mode, when in (("a", 0o600, 1), ("b", 0o664, 2_000_000_000)):
        stage = tmp_path / name
        stage.mkdir()
        (stage / "x.py").write_text("x = 1\n")
        (stage / "run.sh").write_text("#!/bin/sh\n")
        (stage / "x.py").chmod(mode)
        (stage / "run.sh").chmod(mode | 0o100)
        for f in ("x.py", "run.sh"):
            os.utime(stage / f, (when, when))
        pack.pack(["x.py", "run.sh"], stage, tmp_path / f"{name}.tar.xz")
    assert pack.sha256(tmp_path / "a.tar.xz") == pack.sha256(tmp_path / "b.tar.xz")
    with tarfile.open(tmp_path / "a.tar.xz") as tar:
        assert {m.name: (m.mode, m.mtime, m.uid, m.uname) for m in tar.getmembers()} == {
            "run.sh": (0o755, 0, 0, ""), "x.py": (0o644, 0, 0, "")}


def test_the_manifest_names_its_machine_dependent_fields_and_the_tools_behind_them():
    assert MANIFEST["machine_dependent"] == pack.MACHINE_DEPENDENT
    assert set(MANIFEST["built_with"]) == {"strip", "pip"}
    stripped = [d["name"] for d in MANIFEST["distributions"] if pack.TRIMS.get(d["name"], pack.Trim()).strip]
    assert stripped and all(any(f"[{name}]" in field for field in pack.MACHINE_DEPENDENT) for name in stripped)


# ---- --verify: another machine holds its packs against the committed manifest ----------------------------


def tiny_manifest(wheel: Path, archive_sha256: str, archive_bytes: int) -> dict:
    return {"distributions": [{"name": "tinykv", "wheel_sha256": pack.sha256(wheel),
                               "archive_sha256": archive_sha256, "archive_bytes": archive_bytes}]}


@pytest.mark.slow  # real `pip install --target` runs
def test_verify_finds_a_pack_from_another_directory_equal_to_the_manifest(tmp_path):
    wheel = tiny_wheel(tmp_path / "built")
    packed = pack_from(wheel, tmp_path / "a" / "wheels", tmp_path / "out", 0o022)["tinykv.tar.xz"]
    size = (tmp_path / "out" / "tinykv.tar.xz").stat().st_size
    [verdict] = pack.verify(tmp_path / "built", tiny_manifest(wheel, packed, size), {"tinykv": "1.0"})
    assert verdict == pack.Verdict("tinykv", True, "", False)


@pytest.mark.slow
def test_verify_reports_an_archive_the_manifest_does_not_hold_and_refuses_another_wheel(tmp_path):
    """Negative controls: a manifest whose archive SHA-256 is another's gives DIFFERS (not machine-dependent:
    ``main`` exits 1 on it), and a wheel that is not the manifest's is refused rather than compared."""
    wheel = tiny_wheel(tmp_path / "built")
    [verdict] = pack.verify(tmp_path / "built", tiny_manifest(wheel, "0" * 64, 1), {"tinykv": "1.0"})
    assert not verdict.same and "manifest 000000000000.. 1 B" in verdict.why and not verdict.machine_dependent
    other = {"distributions": [{**tiny_manifest(wheel, "0" * 64, 1)["distributions"][0], "wheel_sha256": "f" * 64}]}
    with pytest.raises(SystemExit, match="not the wheel the manifest was built from"):
        pack.verify(tmp_path / "built", other, {"tinykv": "1.0"})
