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

:mod:`kvalign.verify.props.tier.servable_sequence` asks the property about a given sequence of requests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
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
          best_worker_overlap: Any = None, host_weight: float | None = None) -> Judgement:
    """Classify one request: the router's per-tier credit for the whole prompt against SGLang's admission.
    ``host_weight``: the router's configured ``host_cache_hit_weight``, said beside ``best_worker_overlap``
    (which it weighs); required with it, so the text never states a weight the router was not given."""
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
        if host_weight is None:
            raise ValueError("judge: best_worker_overlap given without the router's host_cache_hit_weight")
        seen += f" (best_worker overlap {best_worker_overlap}, with host weight {host_weight:g})"
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


def last_page_condition() -> str:
    """Where LAST_PAGE_CAPPED occurs (a page exists past the cap only at a page boundary)."""
    return ("only for a prompt that ends exactly at a page boundary (plain keys: N % page == 0; EAGLE: (N - 1) % page "
            "== 0) with every page cached; one block per request, at every page size, HiCache on or off")
