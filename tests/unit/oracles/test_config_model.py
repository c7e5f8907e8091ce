"""Config-only model directories: one per content in kvalign's cache, nothing left in the temp directory."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from kvalign.oracles.config_model import config_model_dir

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512}


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A cache of its own and a temp directory of its own, so what either holds after a call is the call's."""
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return cache, tmp


def test_the_same_config_is_one_directory_in_the_cache_and_nothing_is_left_in_the_temp_directory(dirs):
    cache, tmp = dirs
    first = config_model_dir("llama", CONFIG)
    assert first == config_model_dir("llama", dict(reversed(CONFIG.items())))  # the content, not its key order
    assert Path(first).name == "llama" and Path(first).is_relative_to(cache / "kvalign" / "models")
    assert json.loads((Path(first) / "config.json").read_text()) == CONFIG
    assert sorted(p.name for p in Path(first).iterdir()) == ["config.json"]  # no part file left beside it
    assert list(tmp.iterdir()) == []


def test_another_config_or_name_is_another_directory(dirs):
    base = config_model_dir("llama", CONFIG)
    assert config_model_dir("llama", {**CONFIG, "vocab_size": 1024}) != base
    assert config_model_dir("mha", CONFIG) != base


def test_a_damaged_file_is_written_again(dirs):
    path = Path(config_model_dir("llama", CONFIG)) / "config.json"
    path.write_text('{"architectures": ')  # a half-written file, as an interrupted writer without the rename left
    assert json.loads((Path(config_model_dir("llama", CONFIG)) / "config.json").read_text()) == CONFIG


def test_the_control_a_cache_that_cannot_be_made_falls_back_to_the_temp_directory_which_the_check_above_sees(dirs):
    cache, tmp = dirs
    cache.write_text("")  # a file where the cache's directory would go: no directory can be made below it
    path = Path(config_model_dir("llama", CONFIG))
    assert json.loads((path / "config.json").read_text()) == CONFIG
    assert path.is_relative_to(tmp) and list(tmp.iterdir()) != []
