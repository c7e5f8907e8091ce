"""How far the router's credit is from the engine's reuse, request by request: a measurement.

In events mode the router's credit equals the engine's reuse except for SGLang's last page
(``router_credits_engine_reuse`` judges that). With ``--no-router-kv-events`` Dynamo's router never
sees the engine's cache: it predicts it from its own routing decisions and expires the prediction
by its approximate cache policy (``ttl``: ``--router-ttl-secs`` after the last routing; ``lru``:
each worker's advertised capacity). Users ask how wrong that prediction is (dynamo #13425,
#13701); this module answers with the same numbers for both modes on the same workload, so the
two can be set side by side, without turning the difference into a pass/fail rule:

* per request, ``router tokens - engine tokens`` (the router's credit on the worker it chose,
  recovered exactly from ``kv_hit_rate``, minus what that worker reused);
* over a run, and per generated workload (each Hypothesis example, named by a digest of its steps,
  so that two runs with the same seed can be shown to have run the same workloads): the mean and
  the worst absolute error per request, how many requests the router over- and under-credited, and
  the tokens it over- and under-credited in all.

Requests whose pages the lossy hop lost on purpose are kept out (their error is the fault's, not
the mode's), as are requests with no exact credit (a ``kv_hit_rate`` that is no k/ceil(N/B)).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any


def summary(errors: list[int], block_size: int) -> dict[str, Any]:
    """Mean / worst absolute error and the over- and under-credit of a list of signed errors."""
    e = errors
    absolute = [abs(x) for x in e]
    return {
        "requests": len(e), "exact": sum(1 for x in e if x == 0),
        "mean_abs_tokens": round(sum(absolute) / len(e), 2) if e else None,
        "worst_abs_tokens": max(absolute, default=None),
        "mean_abs_blocks": round(sum(absolute) / len(e) / block_size, 3) if e else None,
        "overcredited": sum(1 for x in e if x > 0), "overcredited_tokens": sum(x for x in e if x > 0),
        "undercredited": sum(1 for x in e if x < 0), "undercredited_tokens": -sum(x for x in e if x < 0),
    }


@dataclass
class Workload:
    """One generated workload (a Hypothesis example): its steps' digest and its errors."""

    digest: Any = field(default_factory=hashlib.sha256)
    steps: int = 0
    errors: list[int] = field(default_factory=list)


@dataclass
class CreditError:
    """Signed per-request errors (router tokens minus engine tokens) and what was left out."""

    block_size: int
    errors: list[int] = field(default_factory=list)
    skipped: int = 0  # hop-faulted on purpose, or no exact credit / no engine figure
    workloads: list[Workload] = field(default_factory=list)

    def begin_workload(self) -> None:
        self.workloads.append(Workload())

    def note_step(self, step: dict[str, Any]) -> None:
        """A step of the current workload, into its digest (the same seed gives the same steps)."""
        if not self.workloads:
            self.begin_workload()
        w = self.workloads[-1]
        w.digest.update(json.dumps(step, sort_keys=True).encode())
        w.steps += 1

    def add(self, router_tokens: int | None, engine_tokens: int | None, *, hop_faulted: bool = False) -> None:
        if hop_faulted or router_tokens is None or engine_tokens is None:
            self.skipped += 1
            return
        self.errors.append(router_tokens - engine_tokens)
        if self.workloads:
            self.workloads[-1].errors.append(router_tokens - engine_tokens)

    def as_json(self) -> dict[str, Any]:
        return {**summary(self.errors, self.block_size), "skipped": self.skipped,
                "by_workload": [{"workload": w.digest.hexdigest()[:12], "steps": w.steps,
                                 **summary(w.errors, self.block_size)} for w in self.workloads if w.steps]}
