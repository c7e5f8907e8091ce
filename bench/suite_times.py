"""The suite's time map: the slowest tests and the time spent per marker and per file.

Built on per-test durations that pytest measures itself (set-up, call and teardown of every test,
as ``--durations=0`` reports them), written to JSON by the ``--durations-json PATH`` option of
``tests/conftest.py``. Either read such a file, or run pytest here and read the one it writes:

    .venv/bin/python bench/suite_times.py out/durations.json
    .venv/bin/python bench/suite_times.py --run -- -m "not slow and not e2e"
    .venv/bin/python bench/suite_times.py out/durations.json --split-durations tests/durations.json

``--split-durations`` writes the same figures as ``pytest-split`` reads them (test id -> seconds),
so the nightly's job matrix (``.github/workflows/kvalign-nightly.yml``) splits the suite into
groups of equal recorded time; tests without a figure (skipped, new) are left out, and
pytest-split gives them the average.

A test's time is its set-up + call + teardown (and ``cpu`` the CPU seconds of the pytest process
and its reaped children over the same span: on a shared machine, where wall time follows the load,
this is the figure to compare), so a module- or session-scoped fixture is charged
to the first test that uses it (and its teardown to the last), exactly as pytest charges it. A test
with several markers counts towards each of them; ``(none)`` is the tests without a marker.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load(path: str | os.PathLike[str]) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("tests"), dict):
        raise ValueError(f"{path}: not a --durations-json file (no 'tests' map)")
    return doc


def total(row: dict) -> float:
    return sum(float(row.get(k, 0.0)) for k in ("setup", "call", "teardown"))


def _opt(row: dict, key: str, width: int, fmt: str) -> str:
    """A column that older files lack (printed as '-')."""
    return f"{row[key]:{width}{fmt}}" if key in row else f"{'-':>{width}}"


def render(doc: dict, top: int = 30) -> str:
    tests: dict[str, dict] = doc["tests"]
    lines = []
    summed = sum(map(total, tests.values()))
    cpu = sum(float(row.get("cpu", 0.0)) for row in tests.values())
    has_cpu = any("cpu" in row for row in tests.values())
    outcomes: dict[str, int] = defaultdict(int)
    for row in tests.values():
        outcomes[row.get("outcome", "unknown")] += 1
    head = f"{len(tests)} tests ({', '.join(f'{n} {o}' for o, n in sorted(outcomes.items()))}); " \
           f"{summed:.1f} s in tests" + (f" ({cpu:.1f} s CPU, children included)" if has_cpu else "")
    if doc.get("session_s") is not None:
        head += f", {doc['session_s']:.1f} s session (collection and imports included)"
    if doc.get("generated_cases") is not None:
        head += f"; {doc['generated_cases']} generated property cases"
    lines.append(head)
    if doc.get("markexpr"):
        lines.append(f"-m {doc['markexpr']!r}")
    lines.append("")
    lines.append(f"top {top} tests (seconds: total = set-up + call + teardown)")
    lines.append(f"{'total':>7} {'setup':>7} {'call':>7} {'teardn':>7} {'cpu':>7} {'cases':>6}  test")
    ranked = sorted(tests.items(), key=lambda kv: total(kv[1]), reverse=True)
    for nodeid, row in ranked[:top]:
        lines.append(f"{total(row):7.2f} {row.get('setup', 0):7.2f} {row.get('call', 0):7.2f} "
                     f"{row.get('teardown', 0):7.2f} {_opt(row, 'cpu', 7, '.2f')} {_opt(row, 'cases', 6, 'd')}  {nodeid}")
    lines.append("")
    lines.append("per marker (a test with several markers counts towards each)")
    per_marker: dict[str, list[float]] = defaultdict(list)
    for row in tests.values():
        for m in row.get("markers") or ["(none)"]:
            per_marker[m].append(total(row))
    for marker, times in sorted(per_marker.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"{sum(times):8.1f} s  {len(times):5d} tests  {marker}")
    lines.append("")
    lines.append("per file (top 15): wall, CPU")
    per_file: dict[str, list[float]] = defaultdict(list)
    file_cases: dict[str, int] = defaultdict(int)
    file_cpu: dict[str, float] = defaultdict(float)
    for nodeid, row in tests.items():
        per_file[nodeid.split("::")[0]].append(total(row))
        file_cases[nodeid.split("::")[0]] += int(row.get("cases", 0))
        file_cpu[nodeid.split("::")[0]] += float(row.get("cpu", 0.0))
    for name, times in sorted(per_file.items(), key=lambda kv: -sum(kv[1]))[:15]:
        cpu_col = f"{file_cpu[name]:7.1f} s" if has_cpu else f"{'-':>7}  "
        lines.append(f"{sum(times):8.1f} s {cpu_col}  {len(times):5d} tests  {file_cases[name]:6d} cases  {name}")
    lines.extend(_per_worker(doc))
    return "\n".join(lines)


def _per_worker(doc: dict) -> list[str]:
    """Each xdist worker's busy time and how long before the session's end it ran out of work: the
    worker that finishes last is the critical path, and the others' idle tails are what a better
    split could win."""
    tests = [row for row in doc["tests"].values() if "worker" in row and "ended" in row]
    if not tests or doc.get("ended") is None:
        return []
    rows: dict[str, list[dict]] = defaultdict(list)
    for row in tests:
        rows[row["worker"]].append(row)
    lines = ["", "per worker: busy (sum of test times), idle at the end (its last test to the session's end)"]
    for worker, own in sorted(rows.items()):
        last = max(float(row["ended"]) for row in own)
        lines.append(f"{sum(map(total, own)):8.1f} s busy {doc['ended'] - last:7.1f} s idle at the end "
                     f"{len(own):5d} tests  {worker}")
    return lines


def split_durations(doc: dict) -> dict[str, float]:
    """pytest-split's ``--durations-path`` map: each test that ran, its set-up + call + teardown."""
    return {test: round(total(row), 3) for test, row in sorted(doc["tests"].items())
            if row.get("outcome") in ("passed", "failed")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", help="a file written by pytest --durations-json")
    ap.add_argument("--run", action="store_true", help="run pytest (arguments after --) and map that run")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--keep", metavar="PATH", help="with --run: keep the JSON at PATH")
    ap.add_argument("--split-durations", metavar="OUT", help="also write pytest-split's durations file to OUT")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)
    args, pytest_args = ap.parse_args(argv[:cut]), argv[cut + 1:]
    if args.run == bool(args.json):
        ap.error("give either a JSON file or --run [-- PYTEST ARGS]")
    if args.run:
        path = args.keep or os.path.join(tempfile.mkdtemp(prefix="suite-times-"), "durations.json")
        rc = subprocess.call([sys.executable, "-m", "pytest", f"--durations-json={path}", *pytest_args], cwd=ROOT)
        if not os.path.exists(path):
            print(f"pytest exited {rc} without writing {path}", file=sys.stderr)
            return 2
    else:
        path = args.json
    try:
        doc = load(path)
    except (OSError, ValueError) as exc:
        print(f"suite_times: {exc}", file=sys.stderr)
        return 2
    print(render(doc, args.top))
    if args.split_durations:
        Path(args.split_durations).write_text(json.dumps(split_durations(doc), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
