"""The stand-in's shared worker children (:mod:`standin_child`)."""

from __future__ import annotations

import pytest
from standin_child import StandinChildren


@pytest.fixture(scope="session")
def standin_children(tmp_path_factory: pytest.TempPathFactory) -> StandinChildren:
    """One child per SGLang release with the stand-in loaded as in a worker, run once per session with every
    section the stand-in's test files added for that release (``tests/xdist_scopes.py`` keeps those files on one
    worker)."""
    return StandinChildren(tmp_path_factory.mktemp("standin-children"))
