"""``kvalign matrix``'s engine: run ``kvalign check`` for every Dynamo x SGLang release pair.

Someone upgrading either side needs to know whether *that pair* is aligned. Each pair runs in its
own subprocess with the two releases put first on ``PYTHONPATH``: the releases' wheels are installed
once, ``--no-deps``, into a per-version directory of a cache outside the repository (a release's
``dynamo._core`` imports without its dependencies; SGLang gets the few packages its wheel pins
exactly — transformers, tokenizers, … — beside it, the rest comes from the running environment).
The installed pair of the running environment is used as is.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvalign.check import MODES, PROPERTIES

DYNAMO_PACKAGES = ("ai-dynamo-runtime", "ai-dynamo")
#: Packages SGLang pins exactly that must match its version (transformers registers model configs
#: by name, so another version fails at import); installed beside it when the environment differs.
SGLANG_COUPLED = ("transformers", "tokenizers", "openai", "xgrammar")
DEFAULT_SGLANG = ("0.5.17", "0.5.19", "0.5.21", "0.5.23")
DEFAULT_DYNAMO_RANGE = ((1, 0, 0), (1, 6, 1))
#: Seconds one pair's check may take before it is reported as an error.
PAIR_TIMEOUT_S = 900


class MatrixError(RuntimeError):
    """The matrix cannot run (a release cannot be installed, the index cannot be read)."""


def cache_root() -> Path:
    """``$KVALIGN_WHEEL_CACHE``, else ``$XDG_CACHE_HOME/kvalign/wheels`` (default ``~/.cache``)."""
    env = os.environ.get("KVALIGN_WHEEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvalign" / "wheels"


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def default_dynamo_versions(run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> list[str]:
    """Every ai-dynamo-runtime release from 1.0.0 to 1.6.1 on the package index (pip's own lookup)."""
    out = run([sys.executable, "-m", "pip", "index", "versions", "ai-dynamo-runtime"], capture_output=True, text=True,
              timeout=120)
    m = re.search(r"Available versions:\s*(.+)", out.stdout or "")
    if out.returncode != 0 or not m:
        raise MatrixError("cannot list ai-dynamo-runtime releases from the package index "
                          f"(pip index versions: {(out.stderr or out.stdout).strip().splitlines()[-1:] or 'no output'}); "
                          "pass --dynamo explicitly")
    lo, hi = DEFAULT_DYNAMO_RANGE
    versions = [v.strip() for v in m.group(1).split(",")]
    return sorted((v for v in versions if lo <= _version_key(v)[:3] <= hi), key=_version_key)


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pip_target(target: Path, requirements: Sequence[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--no-compile", "--upgrade", "--target", str(target), *requirements]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        lines = [ln for ln in (res.stderr or res.stdout).splitlines() if "is ignored" not in ln and ln.strip()]
        raise MatrixError(f"cannot install {' '.join(requirements)}: {lines[-1] if lines else 'pip failed'}")


def _pins(target: Path, dist: str, wanted: Sequence[str]) -> list[str]:
    """``name==version`` requirements the installed ``dist`` in ``target`` pins exactly, for ``wanted`` names."""
    meta = next(target.glob(f"{dist.replace('-', '_')}-*.dist-info/METADATA"), None)
    if meta is None:
        return []
    pins = []
    for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
        m = re.match(r"Requires-Dist:\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;,]+)\s*$", line)
        if m and m.group(1).lower() in wanted:
            pins.append(f"{m.group(1)}=={m.group(2)}")
    return pins


def ensure_release(kind: str, version: str, *, log: Callable[[str], None] = lambda _m: None) -> Path | None:
    """The directory holding ``kind`` (``dynamo`` / ``sglang``) at ``version``; None = the running environment's.

    Installed once per version (a ``.complete`` marker makes the cache reusable; a lock makes
    concurrent runs safe); a cold cache downloads each wheel once.
    """
    dist = "ai-dynamo-runtime" if kind == "dynamo" else "sglang"
    if installed(dist) == version and (kind == "sglang" or installed("ai-dynamo") == version):
        return None
    target = cache_root() / f"{'ai-dynamo' if kind == 'dynamo' else 'sglang'}-{version}"
    done = target / ".complete"
    if done.exists():
        return target
    with _locked(target):
        if done.exists():
            return target
        log(f"installing {dist} {version} into {target}")
        start = time.perf_counter()
        if kind == "dynamo":
            _pip_target(target, [f"{d}=={version}" for d in DYNAMO_PACKAGES])
        else:
            _pip_target(target, [f"sglang=={version}"])
            coupled = [p for p in _pins(target, "sglang", SGLANG_COUPLED) if installed(p.split("==")[0]) != p.split("==")[1]]
            if coupled:
                _pip_target(target, coupled)
        done.write_text(f"{time.perf_counter() - start:.1f}s\n")
    return target


@dataclass
class PairResult:
    """One pair's verdict, with the failing rows of its check as findings."""

    dynamo: str
    sglang: str
    verdict: str  # aligned | misaligned | error
    findings: list[dict[str, str]] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    def as_json(self) -> dict[str, Any]:
        return {"dynamo": self.dynamo, "sglang": self.sglang, "verdict": self.verdict, "findings": self.findings}


def pair_env(dynamo_dir: Path | None, sglang_dir: Path | None, sglang_version: str) -> dict[str, str]:
    """The subprocess environment for one pair: its releases first on the path, then this kvalign."""
    root = str(Path(__file__).resolve().parents[1])
    parts = [str(p) for p in (dynamo_dir, sglang_dir) if p is not None] + [root]
    env = dict(os.environ)
    if env.get("PYTHONPATH"):
        parts.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(parts)
    # SGLang's event hash JIT-builds one C++ extension per version; keep it in the cache, not the venv.
    env["TORCH_EXTENSIONS_DIR"] = str(cache_root() / "torch-extensions" / f"sglang-{sglang_version}")
    env.setdefault("DYN_LOG", "error")
    return env


def run_pair(dynamo: str, sglang: str, *, examples: int, ingest_examples: int,
             log: Callable[[str], None] = lambda _m: None) -> PairResult:
    """Install (if needed) and check one pair in a subprocess."""
    start = time.perf_counter()
    try:
        env = pair_env(ensure_release("dynamo", dynamo, log=log), ensure_release("sglang", sglang, log=log), sglang)
    except (MatrixError, subprocess.TimeoutExpired, OSError) as exc:
        return PairResult(dynamo, sglang, "error", error=str(exc), seconds=time.perf_counter() - start)
    cmd = [sys.executable, "-m", "kvalign", "check", "--json", "--examples", str(examples),
           "--ingest-examples", str(ingest_examples)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=PAIR_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return PairResult(dynamo, sglang, "error", error=f"check did not finish within {PAIR_TIMEOUT_S}s",
                          seconds=time.perf_counter() - start)
    seconds = time.perf_counter() - start
    if res.returncode not in (0, 1):
        err = [ln for ln in res.stderr.splitlines() if ln.strip()]
        return PairResult(dynamo, sglang, "error", error=err[-1] if err else f"check exited {res.returncode}", seconds=seconds)
    report = None
    for line in reversed(res.stdout.splitlines()):  # the report is check's last line; a library may print before it
        if line.startswith("{"):
            try:
                report = json.loads(line)
                break
            except json.JSONDecodeError:
                pass
    if report is None:
        err = [ln for ln in res.stderr.splitlines() if ln.strip()]
        return PairResult(dynamo, sglang, "error", seconds=seconds,
                          error=f"check exited {res.returncode} without a JSON report" + (f": {err[-1]}" if err else ""))
    findings = [{"property": r["prop"], "mode": r["mode"], "variant": r["variant"], "cause": r["cause_name"] or "UNKNOWN",
                 "detail": r["detail"] or ""} for r in report["rows"] if r["mismatches"]]
    verdict = "aligned" if report["aligned"] else "misaligned"
    return PairResult(dynamo, sglang, verdict, findings, seconds=seconds)


def run_matrix(dynamo: Sequence[str], sglang: Sequence[str], *, examples: int, ingest_examples: int, jobs: int = 1,
               progress: Callable[[PairResult, int, int], None] | None = None,
               log: Callable[[str], None] = lambda _m: None) -> list[PairResult]:
    """Every pair, ``jobs`` at a time; results in (dynamo, sglang) order, progress as pairs finish."""
    pairs = [(d, s) for d in dynamo for s in sglang]
    # Install every release first, one at a time (pip and the disk are the bottleneck, not the CPU).
    for kind, versions in (("dynamo", dynamo), ("sglang", sglang)):
        for v in versions:
            try:
                ensure_release(kind, v, log=log)
            except MatrixError:
                pass  # reported by the pairs that need it
    results: dict[tuple[str, str], PairResult] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run_pair, d, s, examples=examples, ingest_examples=ingest_examples, log=log): (d, s)
                   for d, s in pairs}
        for fut in as_completed(futures):
            results[futures[fut]] = fut.result()
            if progress:
                progress(results[futures[fut]], len(results), len(pairs))
    return [results[p] for p in pairs]


def _cell(findings: Sequence[dict[str, str]]) -> str:
    return "ok" if not findings else ", ".join(dict.fromkeys(f["cause"] for f in findings))


def table(results: Sequence[PairResult], props: Sequence[str] = PROPERTIES, modes: Sequence[str] = MODES) -> str:
    """One row per pair, one column per property x mode; a cell is ``ok`` or the causes found."""
    head = ["dynamo", "sglang", "verdict", *[f"{p}:{m}" for p in props for m in modes]]
    body = []
    for r in results:
        if r.verdict == "error":
            cells = ["error"] * (len(head) - 3)
        else:
            cells = [_cell([f for f in r.findings if f["property"] == p and f["mode"] == m]) for p in props for m in modes]
        body.append([r.dynamo, r.sglang, r.verdict, *cells])
    widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])
