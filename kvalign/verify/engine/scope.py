"""What a ``check`` or ``matrix`` verdict speaks for: the properties that ran, and the deployment
surfaces of those that did not.

A bare ALIGNED over a surface kvalign did not look at reads as a clean bill for it: on the pinned
pair the default run is aligned while the opt-in ``hybrid``, ``storage`` and ``mm`` properties hold
cache-blind findings. So every verdict carries its scope: "aligned for deployments without image
prompts, hybrid models or a storage tier", with the properties that did not run and how to run them.
A property every deployment exercises (block keys, events) that did not run narrows the verdict to
the properties that did.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvalign.verify.engine.property import Property


@dataclass(frozen=True)
class Scope:
    """The properties a run covered and those it did not (with their surfaces), in registry order."""

    ran: tuple[str, ...]
    not_run: tuple[tuple[str, str | None], ...]

    @classmethod
    def of(cls, registry: Sequence[Property], ran: Iterable[str]) -> Scope:
        names = set(ran)
        return cls(tuple(p.name for p in registry if p.name in names),
                   tuple((p.name, p.surface) for p in registry if p.name not in names))

    @property
    def complete(self) -> bool:
        return not self.not_run

    def aligned_for(self) -> str:
        """What an ALIGNED verdict covers, in words: ``every property``, ``deployments without X, Y or Z``
        (only surface-bound properties left out), or ``what ran only: a, b`` (a universal one left out)."""
        if self.complete:
            return "every property"
        if any(surface is None for _, surface in self.not_run):
            return f"what ran only: {', '.join(self.ran)}"
        surfaces = list(dict.fromkeys(surface for _, surface in self.not_run if surface))
        said = surfaces[0] if len(surfaces) == 1 else f"{', '.join(surfaces[:-1])} or {surfaces[-1]}"
        return f"deployments without {said}"

    def not_run_line(self) -> str | None:
        """``not run: mm, hybrid, storage (--all runs every property)``, or None when everything ran."""
        if self.complete:
            return None
        return f"not run: {', '.join(name for name, _ in self.not_run)} (--all runs every property)"

    def as_json(self) -> dict[str, object]:
        return {"ran": list(self.ran), "not_run": [{"property": n, "surface": s} for n, s in self.not_run],
                "aligned_for": self.aligned_for()}
