"""kvalign/standins/scheduler.py: the scheduler process's config and model config, for SGLang's admission code.

The config is SGLang's own projection of a real ``ServerArgs`` with the HiCache flags (only its
model resolution is left out); the model config answers exactly the fields the admission path reads.
"""

from __future__ import annotations

import types
from typing import Any

import pytest


@pytest.fixture
def standin(sglang_available: str) -> Any:
    from kvalign.standins.hicache import version_problem

    if version_problem(sglang_available):
        pytest.skip(version_problem(sglang_available))
    from kvalign.standins import scheduler

    return scheduler


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_the_context_is_sglangs_projection_of_the_hicache_flags(standin, policy):
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    defaults, before = ServerArgs(model_path="x"), rc.get_context()
    with rc.use_context(standin.scheduler_context(4, policy)):
        assert rc.get_memory().hicache_write_policy == policy and rc.get_memory().enable_hierarchical_cache
        assert rc.get_schedule().page_size == 4
        # what the admission path reads beyond the flags: SGLang's own defaults
        assert rc.get_schedule().schedule_policy == defaults.schedule_policy
        assert rc.get_memory().hicache_storage_backend == defaults.hicache_storage_backend is None
    assert rc.get_context() is before  # the process-wide context is left alone


def test_the_model_config_answers_exactly_what_the_admission_path_reads(standin, monkeypatch):
    from kvalign.oracles.hicache import HiCacheEngine

    read: set[str] = set()

    class Recording(types.SimpleNamespace):
        def __getattribute__(self, name: str) -> Any:
            if not name.startswith("__"):
                read.add(name)
            return super().__getattribute__(name)

    monkeypatch.setattr(standin, "MODEL_CONFIG", Recording(**vars(standin.MODEL_CONFIG)))
    e = HiCacheEngine(4, eagle=True, core="unified", policy="write_back", host_tokens=1 << 20)
    assert e.serve(list(range(1, 10))).admitted and e.serve(list(range(1, 12))).device_tokens == 8
    assert read == set(vars(standin.MODEL_CONFIG))
