"""A ``check`` row, and the modes, variants and event formats rows are drawn from: the leaf that the
check engine, the property modules, the matrix and the report all read, so none imports another for a type.
(Which properties there are, and what each runs: :data:`kvalign.verify.props.REGISTRY`.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MODES = ("plain", "eagle")
#: SGLang's KV-event formats (``KVEventsConfig.format``; "dynamo" from 0.5.23).
EVENT_FORMATS = ("default", "dynamo")
VARIANTS = {"base": (False, False), "lora": (True, False), "namespace": (False, True), "lora+namespace": (True, True)}


@dataclass
class RowResult:
    """One property x mode x variant run."""

    prop: str
    mode: str
    variant: str
    #: generated examples (or exhaustive cases) the row ran; a search's shrink steps are not cases
    cases: int = 0
    #: of them, those that failed (a search stops generating at its first failing example, to shrink it)
    mismatches: int = 0
    seconds: float = 0.0
    cause: str | None = None
    cause_name: str | None = None
    detail: str | None = None
    counterexample: Any = None
    #: the configurations the row's mismatch is confined to (e.g. HiCache on, page sizes below 10), or None
    condition: str | None = None
    #: why the row is ``n/a``, never ok: it did not run at all (kvalign's own stand-in does not cover this
    #: release; ``cases`` 0), or it ran and no example exercised what it checks (no refill loaded back, no
    #: hybrid state lost: a pass that could not have failed; ``cases`` > 0)
    skipped: str | None = None
    #: what of a row that ran was not checked, and why (e.g. configurations kvalign's platform stand-in cannot resolve)
    not_checked: str | None = None
    #: the admitted request of a HiCache row's shrunk counterexample, as SGLang's scheduler reports it
    #: (prompt_tokens, device_tokens, host_only_tokens, loaded_tokens, ...), or None
    admission: dict[str, Any] | None = None
    #: causes counted apart from the mismatches (never failing the row): name -> cases, cause, condition, example
    scoped: dict[str, Any] | None = None
    #: SGLang's KV-event format the row's events were published in ("any": the property reads no events)
    event_format: str = "default"
    #: a finding's class (kvalign.model.causes.CLASSES; JSON key ``class``), None for a clean or n/a row
    finding_class: str | None = None
    #: a credit skew's bound (KV slots credited and not served per request, from the packages' constants)
    bound_tokens: int | None = None
    #: a credit skew's measured routing impact: does the real router pick another worker than the one that reuses most
    changes_worker: bool | None = None
    #: the bound and the routing impact, in words
    impact: str | None = None
    #: the routing measurements behind :attr:`impact`: per measurement its set-up, and per trial how often
    #: the real router picked each candidate over repeated routings (a split is a tie, never a flip) and what
    #: each engine reused; for storage, which cause each wrong choice is owed to (issue 43)
    routing: dict[str, Any] | None = None
    #: the row's negative control, where it runs one beside the search (hybrid, storage): the deliberate
    #: misalignment, its cases, whether the property failed on it and with which cause
    control: dict[str, Any] | None = None
    #: the calls a search made after its first failing example (shrinking it, then replaying the shrunk
    #: one): counted apart, never as cases, so that "1 of 3" is what the search generated (issue 43)
    shrink_steps: int = 0
    #: a mismatch that did not recur every time its example was replayed: how often it did ("3 of 10
    #: replays"). Shown, never a finding: it fails nothing (:mod:`kvalign.verify.confirm`)
    unconfirmed: str | None = None

    @property
    def ok(self) -> bool:
        """No mismatch (a row that did not run is not ok either: it is ``n/a``, :attr:`status`)."""
        return self.mismatches == 0 and not self.skipped

    @property
    def status(self) -> str:
        """``n/a`` (did not run, or never exercised its subject: :attr:`skipped`), ``ok``, ``unconfirmed`` (a
        mismatch that did not recur on every replay), or ``finding``."""
        return ("n/a" if self.skipped else "unconfirmed" if self.unconfirmed else "ok" if self.mismatches == 0
                else "finding")


def row_json(r: RowResult) -> dict[str, Any]:
    """A row as ``check --json`` prints it: every field, ``status``, and ``class`` (for a finding; the
    bound and routing impact where measured)."""
    d = asdict(r)
    d["class"] = d.pop("finding_class")
    d["status"] = r.status
    return d
