"""The tree-page rule (CUDA allocator construction, stood in) against the installed SGLang's source."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvalign.standins import kv_pages


def _srt() -> Path:
    from kvalign.oracles.sglang import _modules, sglang_version

    _modules()
    if kv_pages.version_problem(sglang_version()):
        pytest.skip(kv_pages.version_problem(sglang_version()))
    import sglang

    return Path(sglang.__file__).parent / "srt"


@pytest.mark.parametrize("path, expression", kv_pages.SOURCE_RULES)
def test_the_rule_is_the_installed_sglangs(path, expression):
    """Both expressions the stand-in restates are in the installed release, verbatim up to whitespace."""
    assert expression in re.sub(r"\s+", "", (_srt() / path).read_text())


def test_tree_page_is_the_page_times_dcp_only_under_dcp():
    from kvalign.oracles.page_overrides import WorkerConfig, platform, resolve

    _srt()
    from sglang.srt.arg_groups.overrides import kv_event_block_size_of, resolving_view

    for config, want in ((WorkerConfig(page_size=16, backend="triton"), 16),
                         (WorkerConfig(page_size=16, backend="triton", dcp_size=2), 32),
                         (WorkerConfig(page_size=1, backend="triton", dcp_size=4), 4)):
        server_args = resolve(config)
        with platform(config.platform):
            view = resolving_view(server_args)
            assert kv_pages.tree_page_size(view) == want == kv_event_block_size_of(view)


def test_an_unpinned_release_is_said():
    assert kv_pages.version_problem("0.5.9") and "0.5.23" in kv_pages.version_problem("0.5.9")
    assert kv_pages.version_problem("0.5.23") is None
