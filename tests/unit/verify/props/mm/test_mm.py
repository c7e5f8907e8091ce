"""The ``mm`` property on the real code of both sides, its finding on the pinned pair, its controls.

``slow``: the property's oracles (Dynamo's frontend process, SGLang's multimodal processor) take
20-40 s of CPU to start, more than the fast tier can carry, so the property's negative controls run
in the whole suite (CI) rather than the fast tier. Each control runs on the aligned baseline
(SGLang 0.5.21's scalar pad rule, :mod:`kvalign.standins.sglang_scalar_pads`), where the property
holds, and must fail naming its own cause.
"""

from __future__ import annotations

import pytest

from kvalign.model.causes import Cause
from kvalign.verify.engine.systems import Systems
from kvalign.verify.props.mm.body import MmSystems, run_mm_search
from kvalign.verify.props.mm.controls import CONTROLS, aligned_baseline, controlled

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mm(mm_oracles, router_hasher, cache_factory, dynamo_tree):
    frontend, sglang = mm_oracles
    systems = Systems(router_hasher, cache_factory("unified"), dynamo_tree)
    yield MmSystems(frontend, sglang, systems.router_path(), router_hasher, real_hasher=True)
    systems.close()


@pytest.fixture(scope="module")
def make_cache(cache_factory):
    return cache_factory("unified")


@pytest.mark.parametrize("eagle", [False, True])
def test_pinned_pair_loses_every_image_requests_pages(mm, make_cache, eagle):
    """Dynamo 1.6.1 x SGLang 0.5.23: SGLang's 62-bit pad values make the relay drop the whole batch."""
    calls, failures, found = run_mm_search(mm, make_cache, eagle=eagle, examples=5)
    assert found is not None and found.cause is Cause.MM_PAD_WIDTH and failures == calls
    assert "block 0 (" in found.detail and "never indexed (0 of" in found.detail
    assert found.example.relation in ("same", "pixel", "prefix", "fresh")


@pytest.mark.parametrize("eagle", [False, True])
def test_aligned_baseline_holds(mm, make_cache, eagle):
    """With the shipped pair's pad rule, router credit = SGLang's reuse on every generated image prompt."""
    with aligned_baseline():
        calls, failures, found = run_mm_search(mm, make_cache, eagle=eagle, examples=40)
    assert found is None and failures == 0 and calls == 40


@pytest.mark.parametrize(("name", "mode"), [(c.name, m) for c in CONTROLS.values() for m in c.modes])
def test_each_control_fails_naming_its_cause(mm, make_cache, name, mode):
    control = CONTROLS[name]
    with aligned_baseline():
        _calls, failures, found = run_mm_search(controlled(mm, control), make_cache, eagle=mode == "eagle", examples=60)
    assert found is not None and failures, f"{name} was not caught"
    assert found.cause is control.cause, found.detail
