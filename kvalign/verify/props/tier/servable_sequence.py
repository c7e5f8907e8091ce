"""The servable property asked about a given sequence of requests: what it says for the same cases as a live run.

:func:`ask_servable` serves each request through SGLang's own scheduler code on the HiCache engine
(:class:`~kvalign.oracles.hicache.HiCacheEngine`), publishes SGLang's events through Dynamo's real
relay into a real ``KvRouter``, and judges every request as the ``servable`` row does
(:func:`kvalign.verify.props.tier.servable.judge`). :func:`worked_case` is the finding's case with a device
prefix, used by the report and the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvalign.verify.props.tier.servable import judge
from kvalign.verify.props.tier.body import TierPath, tenant_kwargs


@dataclass
class RequestVerdict:
    """One request of :func:`ask_servable`'s sequence, as the property judges it."""

    step: int
    tokens: list[int]
    judgement: dict[str, Any] = field(default_factory=dict)


def ask_servable(steps: Sequence[tuple[Any, ...]], *, page_size: int, eagle: bool = False,
                 policy: str = "write_through", core: str = "unified", host_tokens: int | None = None,
                 device_tokens: int | None = None, router_path: Any = None,
                 make_engine: Callable[..., Any] | None = None) -> list[RequestVerdict]:
    """What the servable property says about a sequence of requests, e.g. a live run's.

    ``steps``: ``("request", tokens)`` or ``("request", tokens, lora_name, cache_salt)`` (served by
    SGLang's scheduler code: matched, admitted, prefilled, cached), ``("transfers_done",)``,
    ``("evict_device", n_tokens)``, ``("evict_host", n_tokens)``, ``("flush",)``. ``device_tokens``
    sizes SGLang's device allocator (as the live worker's ``max_total_num_tokens``; None: no
    pressure), ``host_tokens`` the host pool (None: unbounded). Each request's events reach a real
    ``KvRouter`` through Dynamo's real relay before the next request is asked about. Returns one
    :class:`RequestVerdict` per request (its :class:`~kvalign.verify.props.tier.servable.Judgement` as a dict: the
    admission as SGLang reports it, the router's credit, ``cause`` and ``last_page_capped``). A request
    SGLang's prefill budget defers (``admission.admitted`` False) is neither prefilled nor cached here,
    where a live scheduler would retry it later.
    """
    from kvalign.oracles.hicache import HiCacheEngine
    from kvalign.oracles.router_path import RouterPath

    own = router_path is None
    tp = TierPath(router_path or RouterPath())
    try:
        worker, tap = tp.worker(page_size, eagle)
        base = worker.token_space()  # this sequence's own token range in a long-lived router
        engine = (make_engine or HiCacheEngine)(page_size, eagle=eagle, core=core, policy=policy,
                                                host_tokens=host_tokens or 1 << 20, device_tokens=device_tokens)
        engine.take_raw_events()
        out: list[RequestVerdict] = []
        for i, step in enumerate(steps):
            kind = step[0]
            if kind == "request":
                tokens, tenant = [base + int(t) for t in step[1]], (tuple(step[2:4]) + (None, None))[:2]
                tiers = tp.path.query_tiers(worker.router, tokens, *tenant)
                best = tp.path.call(worker.router.best_worker, tokens, **tenant_kwargs(tenant))
                j = judge(engine.serve(tokens, *tenant), tiers, page_size, eagle=eagle,
                          threshold=engine.load_back_threshold, best_worker_overlap=best[2],
                          host_weight=tp.path.host_weight)
                out.append(RequestVerdict(i, list(step[1]), j.as_dict()))
            elif kind == "transfers_done":
                engine.transfers_done()
            elif kind == "evict_device":
                engine.evict(int(step[1]))
            elif kind == "evict_host":
                engine.evict_host(int(step[1]))
            elif kind == "flush":
                engine.reset()
            else:
                raise ValueError(f"unknown step {step!r}")
            events = engine.take_raw_events()
            if events:
                worker.publisher.publish(events)
                unsettled = tp.settle(worker, tap)
                if unsettled is not None:
                    raise RuntimeError(f"the router did not settle after step {i} {step!r}: {unsettled[1]}")
        return out
    finally:
        tp.close()
        if own:
            tp.path.close()


def worked_case(eagle: bool) -> list[tuple[Any, ...]]:
    """The HOST_CREDIT_NOT_SERVABLE case the cap cannot explain, as :func:`ask_servable` steps (page 4):
    8 then 16 tokens cached (bigram keys: one token more each, the second extending the first), device
    pressure evicts the 8-token leaf to host, then a 21-token prompt (22 under EAGLE) arrives. SGLang's
    scheduler matches at most 20 tokens: 2 pages on device, 2 host-only pages (8 slots, below
    ``load_back_threshold`` 10): it loads 0 back and re-prefills them; the router credits 2 + 2 blocks."""
    first = list(range(1, 9 + int(eagle)))
    second = first + [3] * 8
    return [("request", first), ("transfers_done",), ("request", second), ("transfers_done",),
            ("evict_device", 8), ("request", second + [2] * 5)]


def worked_cases(router_path: Any = None) -> list[dict[str, Any]]:
    """:func:`worked_case` on every tree core this SGLang has, plain and EAGLE: the last request's judgement each."""
    from kvalign.oracles.hicache import available_cores

    out = []
    for eagle in (False, True):
        for core in available_cores():
            *_, last = ask_servable(worked_case(eagle), page_size=4, eagle=eagle, core=core, router_path=router_path)
            out.append({"mode": "eagle" if eagle else "plain", "core": core, **last.judgement})
    return out
