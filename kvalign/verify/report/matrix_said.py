"""What a ``kvalign matrix --json`` run says, row by row, timings and examples apart: two runs compared.

Issue 46: the release matrix is only worth reading if the same command says the same thing twice. A
run is reduced to what a user acts on, per pair and row: the pair's verdict, and each row's class,
cause and status (a finding, unconfirmed, ``n/a`` with the kind of reason, or ``ok`` where the pair's
report names it nowhere). Rates, example values, details and seconds differ between honest runs and
are left out. A row ``n/a`` because only the in-process relay showed its mismatch and the relay in its
own process then ran it clean says what an ``ok`` row says of the release (as deployed, its cases ran
clean), and which rows the in-process relay trips on depends on where it happens to stop in a run
(:mod:`kvalign.verify.runner.confirm`): it counts as ``ok`` here. One whose re-check could not run stays
``n/a``. ``python -m kvalign.verify.report.matrix_said A.json B.json`` prints each difference, one
a line, and exits 1 where there is any (0: the two runs say the same).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvalign.verify.runner.confirm import IN_PROCESS_ONLY

#: a row's key: (pair "DYNAMO x SGLANG", "property/mode/variant/format"), or the pair's own ("...", "verdict")
Key = tuple[str, str]
#: what a run says of it: (class, cause, status); a verdict is (verdict, None, "verdict")
Said = tuple[str | None, str | None, str]

OK: Said = (None, None, "ok")


def said(doc: dict[str, Any]) -> dict[Key, Said]:
    """Each pair's verdict and each row its report names, as (class, cause, status)."""
    out: dict[Key, Said] = {}
    for pair in doc["rows"]:
        name = f"{pair['dynamo']} x {pair['sglang']}"
        out[(name, "verdict")] = (pair["verdict"], None, "verdict")

        def row(r: dict[str, Any]) -> str:
            return f"{r['property']}/{r['mode']}/{r['variant']}/{r.get('event_format', 'default')}"

        for f in pair.get("findings", []):
            out[(name, row(f))] = (f["class"], f["cause"], "finding")
        for u in pair.get("unconfirmed", []):
            out[(name, row(u))] = (None, u["cause"], "unconfirmed")
        for n in pair.get("not_applicable", []):  # the kind of reason: what precedes its first colon
            reason = n["reason"]
            if reason.startswith(IN_PROCESS_ONLY) and reason.endswith("case(s) ran clean"):
                continue  # ok as deployed (see above)
            out[(name, row(n))] = ("n/a", None, f"n/a: {reason.split(':', 1)[0]}")
    return out


def differences(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """One line per row (or verdict) the two runs say differently; empty when they agree."""
    a, b = said(first), said(second)
    return [f"{k[0]} {k[1]}: {a.get(k, OK)} | {b.get(k, OK)}" for k in sorted(a.keys() | b.keys())
            if a.get(k, OK) != b.get(k, OK)]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m kvalign.verify.report.matrix_said FIRST.json SECOND.json", file=sys.stderr)
        return 2
    try:
        docs = [json.loads(Path(p).read_text(encoding="utf-8")) for p in args]
        lines = differences(*docs)
    except (OSError, json.JSONDecodeError) as exc:
        print(f"kvalign: error: {exc}", file=sys.stderr)
        return 2
    except (KeyError, TypeError) as exc:
        print(f"kvalign: error: not a kvalign matrix --json report: no {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines) if lines else "the two runs say the same of every row")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
