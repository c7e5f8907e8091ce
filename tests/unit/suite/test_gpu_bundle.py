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
