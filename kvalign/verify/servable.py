"""The ``servable`` property's judgement of one admitted request, and the property asked about a sequence of requests.

The router credits a prompt's blocks from its index: ``device_blocks``, then
``host_pinned_extension_blocks`` past them (what the engine's tree holds). What the engine reuses
is what SGLang's scheduler admits (:class:`~kvalign.oracles.admission.Admission`): a match capped
at ``input_len - 1`` tokens (``Req._compute_max_prefix_len``), and a host-only stretch loaded back
only when ``_load_back_transfers`` accepts it. :func:`judge` keeps the two reasons the engine can
reuse less than the router credits apart:

* a credited block past the scheduler's cap is ``LAST_PAGE_CAPPED``, counted apart: the router
  credits the page holding the prompt's last token, the engine computes it again (the live fuzz's
  last-page rule); never a mismatch, never ``HOST_CREDIT_NOT_SERVABLE``;
* a credited host block *inside* the capped prefix that SGLang did not load back is
  ``HOST_CREDIT_NOT_SERVABLE``: the engine re-prefills what the router credited.

:func:`ask_servable` runs a given sequence of requests (and evictions) through the same engine and
router path and says, per request, what the property says: the cases a live run can be compared with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvalign.model.causes import Cause
from kvalign.oracles.admission import Admission

#: Router tier keys (``get_overlap_scores``) for the device prefix and the host-only blocks past it.
DEVICE, HOST = "device_blocks", "host_pinned_extension_blocks"


@dataclass(frozen=True)
class Judgement:
    """What the servable property says about one request: ``cause`` None (served as credited, or only
    ``capped_blocks`` past SGLang's cap) or ``HOST_CREDIT_NOT_SERVABLE``."""

    admission: Admission
    router_device: int
    router_host: int
    #: router-credited blocks past SGLang's capped match (LAST_PAGE_CAPPED when > 0; counted apart)
    capped_blocks: int
    #: router-credited host blocks inside the capped match
    host_in_cap: int
    cause: Cause | None
    detail: str

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cause"] = self.cause.name if self.cause else None
        d["last_page_capped"] = self.capped_blocks > 0
        return d


def judge(admission: Admission, tiers: dict[str, int], page_size: int, *, eagle: bool, threshold: int,
          best_worker_overlap: Any = None) -> Judgement:
    """Classify one request: the router's per-tier credit for the whole prompt against SGLang's admission."""
    p, unit = page_size, "bigram" if eagle else "token"
    rd, rh = int(tiers[DEVICE]), int(tiers[HOST])
    matched = (admission.device_tokens + admission.host_only_tokens) // p
    capped = max(0, rd + rh - matched)
    host_in_cap = max(0, min(rd + rh, matched) - rd)
    a = admission
    seen = (f"page size {p}: a {a.prompt_tokens}-token prompt; SGLang's scheduler matches at most {a.max_prefix_tokens} "
            f"tokens of it (Req._compute_max_prefix_len): {a.device_tokens} {unit}s on device + {a.host_only_tokens} on "
            f"host only; the router credits {rd} device + {rh} host block(s)")
    if best_worker_overlap is not None:
        seen += f" (best_worker overlap {best_worker_overlap}, with host weight 0.75)"
    if a.admitted and host_in_cap and a.loaded_tokens < a.host_only_tokens:
        why = (f"below SGLang's load_back_threshold ({threshold}), so SGLang loaded {a.loaded_tokens} back"
               if a.host_only_tokens < threshold else
               f"not below SGLang's load_back_threshold ({threshold}), yet SGLang loaded {a.loaded_tokens} back "
               "(its device pool could not take the load)")
        return Judgement(a, rd, rh, capped, host_in_cap, Cause.HOST_CREDIT_NOT_SERVABLE,
                         f"{seen}; the host-only stretch is {a.host_only_tokens} {unit}s, {why} and re-prefills it "
                         f"({host_in_cap} credited host block(s) inside the capped prefix)")
    if capped:
        return Judgement(a, rd, rh, capped, host_in_cap, None,
                         f"{seen}; {capped} credited block(s) lie past the scheduler's cap: the engine computes them "
                         f"again ({Cause.LAST_PAGE_CAPPED.name}, counted apart)")
    return Judgement(a, rd, rh, capped, host_in_cap, None, seen)


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


def last_page_condition() -> str:
    """Where LAST_PAGE_CAPPED occurs (a page exists past the cap only at a page boundary)."""
    return ("only for a prompt that ends exactly at a page boundary (plain keys: N % page == 0; EAGLE: (N - 1) % page "
            "== 0) with every page cached; one block per request, at every page size, HiCache on or off")


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
    :class:`RequestVerdict` per request (its :class:`Judgement` as a dict: the admission as SGLang
    reports it, the router's credit, ``cause`` and ``last_page_capped``).
    """
    from kvalign.oracles.hicache import HiCacheEngine
    from kvalign.oracles.router_path import RouterPath
    from kvalign.verify.tier import TierPath, tenant_kwargs

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
                          threshold=engine.load_back_threshold, best_worker_overlap=best[2])
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
