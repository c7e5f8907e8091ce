"""One routing trial of a finding's state against a second candidate, and how trials are said (issue 43).

Every routing-impact measurement (:mod:`kvalign.verify.engine.impact`, :mod:`kvalign.verify.props.storage.impact`,
:mod:`kvalign.verify.props.hybrid.impact`) holds the real router's choice against what each engine reuses, one
:class:`Trial` per ``k`` (the pages the second candidate holds). Where both candidates cost the same the
router breaks the tie at random, so each state is routed many times and a split is a tie: never a flip,
never a headline, and its share is said beside the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Past the prompt's cached pages, the counterexample's prompt goes on by this many tokens (SGLang caps a
#: match below the last token, so the cached pages are all matchable).
TAIL = 1
#: A split is a tie when each candidate got at least this share of the routings. A tie the router breaks at
#: random leaves fewer than 10 of 40 to one side with probability about 0.002; a stray pick or two is not a
#: tie (seen once: 1 vs 39 on a state crediting 0 against 17 blocks) and the majority is the choice.
TIE_SHARE = 0.25


@dataclass
class Trial:
    """One ``k``: the other candidate holds the prompt's first ``k`` pages on device.

    ``picks``: how many of :data:`~kvalign.oracles.router_pair.ROUTES` routings of the same state picked
    each candidate (rank 0: the counterexample's engine). Both picked is a tie the router broke at random:
    it has no choice to change, so a tie is never a flip and never a headline (issue 43)."""

    k: int
    picks: tuple[int, int]
    reused: tuple[int, int]  # what each candidate's engine reused of the prompt, in tokens

    @property
    def tie(self) -> bool:
        """Each candidate picked in at least :data:`TIE_SHARE` of the routings: a tie broken at random."""
        return min(self.picks) >= TIE_SHARE * sum(self.picks)

    @property
    def chosen(self) -> int | None:
        """The rank the router picked (in all routings, or all but a stray few), None for a tie."""
        return None if self.tie else (0 if self.picks[0] > self.picks[1] else 1)

    @property
    def changed(self) -> bool:
        """The router picked the candidate that reuses strictly less."""
        c = self.chosen
        return c is not None and self.reused[1 - c] > self.reused[c]

    def picked(self) -> str:
        """What the router did, in words: ``picks first`` / ``picks other`` (every time), or the tie's split."""
        if self.tie:
            return f"a tie ({self.picks[0]} vs {self.picks[1]} of {sum(self.picks)} routings)"
        stray = min(self.picks)
        return (f"picks {'first' if self.chosen == 0 else 'other'}"
                + (f" ({max(self.picks)} of {sum(self.picks)} routings)" if stray else ""))

    def as_dict(self) -> dict[str, Any]:
        return {"k": self.k, "picks": list(self.picks), "reused": list(self.reused), "tie": self.tie,
                "changed": self.changed}


def worst_flip(trials: Sequence[Trial]) -> Trial | None:
    """The trial where the router's choice cost the most reuse (None: it changed no choice): a headline."""
    flips = [t for t in trials if t.changed]
    return max(flips, key=lambda t: t.reused[1 - t.chosen] - t.reused[t.chosen]) if flips else None


def tie_share(trials: Sequence[Trial]) -> str:
    """How many of the trials a tie decided (the router split its picks), in words."""
    ties = [t for t in trials if t.tie]
    if not ties:
        return f"no tie in {len(trials)} k (each routed {sum(trials[0].picks) if trials else 0} times)"
    return (f"a tie decided {len(ties)} of {len(trials)} k ("
            + ", ".join(f"k={t.k}: {t.picks[0]} vs {t.picks[1]}" for t in ties) + " routings; not counted as flips)")


def trials_said(trials: Sequence[Trial]) -> str:
    """Every trial's outcome, in words (where nothing changed the worker, all of them are the finding)."""
    return ", ".join(f"k={t.k}: {t.picked()} ({t.reused[0]} vs {t.reused[1]} reused)" for t in trials)
