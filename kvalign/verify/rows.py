"""A ``check`` row and the table it is drawn from: the leaf that the check engine, the tier rows,
the matrix and the report all read, so none of them imports another for a type.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

PROPERTIES = ("card", "advertised", "hash", "pages", "overlap", "ingest", "tenants", "tier", "servable", "dp", "mm")
#: What ``check`` and ``matrix`` run without ``--property``: ``mm`` is opt-in, since it starts Dynamo's
#: frontend and SGLang's multimodal processor (20-40 s on two cores) and needs both releases' multimodal paths.
DEFAULT_PROPERTIES = tuple(p for p in PROPERTIES if p != "mm")
MODES = ("plain", "eagle")
#: Properties that do not run in every mode (the page size a worker registers does not depend on EAGLE's keys;
#: no DP rank decision reads the key mode).
PROPERTY_MODES = {"advertised": ("plain",), "dp": ("plain",)}
#: SGLang's KV-event formats (``KVEventsConfig.format``; "dynamo" from 0.5.23), and the properties whose rows
#: read SGLang's events (run once per format); the others carry ``event_format`` "any".
EVENT_FORMATS = ("default", "dynamo")
EVENT_PROPERTIES = ("pages", "overlap", "ingest", "tier", "servable", "tenants", "mm")
#: Properties that read SGLang's events from caches of their own, in the default format (run once).
DEFAULT_FORMAT_PROPERTIES = ("dp",)
VARIANTS = {"base": (False, False), "lora": (True, False), "namespace": (False, True), "lora+namespace": (True, True)}


@dataclass
class RowResult:
    """One property x mode x variant run."""

    prop: str
    mode: str
    variant: str
    cases: int = 0
    mismatches: int = 0
    seconds: float = 0.0
    cause: str | None = None
    cause_name: str | None = None
    detail: str | None = None
    counterexample: Any = None
    #: the configurations the row's mismatch is confined to (e.g. HiCache on, page sizes below 10), or None
    condition: str | None = None
    #: why the row did not run at all (kvalign's own stand-in does not cover this release): ``n/a``, never ok
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

    @property
    def ok(self) -> bool:
        """No mismatch (a row that did not run is not ok either: it is ``n/a``, :attr:`status`)."""
        return self.mismatches == 0 and not self.skipped

    @property
    def status(self) -> str:
        """``n/a`` (did not run), ``ok``, or ``finding``."""
        return "n/a" if self.skipped else "ok" if self.mismatches == 0 else "finding"


def row_json(r: RowResult) -> dict[str, Any]:
    """A row as ``check --json`` prints it: every field, ``status``, and ``class`` (for a finding; the
    bound and routing impact where measured)."""
    d = asdict(r)
    d["class"] = d.pop("finding_class")
    d["status"] = r.status
    return d
