"""kvalign.model.sglang_keys.matchable_pages, held equal to SGLang's own scheduler cap.

``diagnose`` reads captures offline and runs no scheduler, so it uses kvalign's statement of the cap;
this test holds it to ``Req._compute_max_prefix_len`` and SGLang's own match of a fully cached prompt.
"""

from __future__ import annotations

import pytest

from kvalign.model.sglang_keys import matchable_pages


@pytest.mark.parametrize("eagle", [False, True], ids=["plain", "eagle"])
@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
def test_matchable_pages_is_what_sglangs_scheduler_matches_of_a_cached_prompt(sglang_available, page_size, eagle):
    from kvalign.oracles.hicache import HiCacheEngine
    from kvalign.standins.hicache import version_problem

    if version_problem(sglang_available):
        pytest.skip(version_problem(sglang_available))
    e = HiCacheEngine(page_size, eagle=eagle, core="unified", policy="write_through", host_tokens=1 << 20)
    for n in range(1, 3 * page_size + 3):
        prompt = [7] * n
        e.serve(prompt)
        a = e.serve(prompt)  # everything SGLang holds of it is cached now; the scheduler's cap decides the rest
        assert a.max_prefix_tokens == n - 1
        assert a.device_tokens // page_size == matchable_pages(n, page_size, eagle=eagle), n
