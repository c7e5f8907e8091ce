"""``kvalign matrix``'s engine: run ``kvalign check`` for every Dynamo x SGLang release pair.

Someone upgrading either side needs to know whether *that pair* is aligned. Each pair runs in its
own subprocess, in a virtual environment of its own that lists the two releases before everything
else (:mod:`kvalign.releases.release_env`): the releases' wheels are installed once, ``--no-deps`` (with uv,
pip as the fallback), into a per-version directory of a cache outside the repository (a release's
``dynamo._core`` imports without its dependencies). SGLang's directory also gets whatever of its
pinned dependency set the running environment does not satisfy — its exact pins (transformers,
openai, …) and, transitively, what those need (transformers 5.12.1 wants tokenizers <= 0.23.0) — so a
release imports with the versions it was released with; the rest comes from the environment.
The installed pair of the running environment is used as is.

The pairs people deploy are each Dynamo release with the SGLang its ``ai-dynamo[sglang]`` extra
pins; :func:`shipped_sglang` reads that pin from the release's own wheel metadata.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from packaging.markers import default_environment
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from kvalign.model.causes import CACHE_BLIND, CREDIT_SKEW, cause_class
from kvalign.releases import local_build
from kvalign.verify.report.finding_status import LIVE_MARK, live_run
from kvalign.oracles.router_path import STUCK_EXIT_S, STUCK_MARK
from kvalign.releases.release_env import ReleaseEnvError, cache_root, child_env, install, locked, python_for
from kvalign.verify import props as registry
from kvalign.verify.engine.scope import Scope
from kvalign.verify.engine.rows import MODES
from kvalign.runtime_log import log_dir

DYNAMO_PACKAGES = ("ai-dynamo-runtime", "ai-dynamo")
#: Packages SGLang pins exactly that must match its version (transformers registers model configs
#: by name, so another version fails at import); installed beside it when the environment differs.
SGLANG_COUPLED = ("transformers", "tokenizers", "openai", "xgrammar")
#: The environment's torch stack is used as is (CPU build, one per venv; a release's CUDA pin is not
#: installable here and the oracles need only the radix cache and the event publisher).
ENVIRONMENT_ONLY = frozenset({"torch", "torchvision", "torchaudio", "triton"})
#: Bumped when a per-version directory must hold more than before: an older cache is completed, not trusted.
INSTALL_SCHEME = 2
#: Rounds of "install what the installed packages still miss" before giving up (depth of the closure).
MAX_DEPENDENCY_ROUNDS = 6
DEFAULT_SGLANG = ("0.5.17", "0.5.19", "0.5.21", "0.5.23")
DEFAULT_DYNAMO_RANGE = ((1, 0, 0), (1, 6, 1))
#: Seconds one pair's check may take before it is reported as an error (30-100 s when it works).
PAIR_TIMEOUT_S = 600
#: Seconds one pair's live scenario (start-up ~2 min on 2 cores, 4 requests) may take.
LIVE_TIMEOUT_S = 900
#: The live scenario's column.
LIVE_COLUMN = "live:disagg-eagle"
#: The column of the rows run with SGLang's "dynamo" KV-event format (``check --event-format both``).
FORMAT_COLUMN = "format:dynamo"


class MatrixError(RuntimeError):
    """The matrix cannot run (a release cannot be installed, the index cannot be read)."""


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


def _install(target: Path, requirements: Sequence[str]) -> None:
    try:
        install(target, requirements)
    except ReleaseEnvError as exc:
        raise MatrixError(str(exc)) from None


def _dist_name(meta: Path) -> str:
    """The canonical distribution name of ``<name>-<version>.dist-info/METADATA``."""
    return canonicalize_name(meta.parent.name.removesuffix(".dist-info").rsplit("-", 1)[0])


def _metadata_file(target: Path, dist: str) -> Path | None:
    return next((m for m in target.glob("*.dist-info/METADATA") if _dist_name(m) == canonicalize_name(dist)), None)


def requires_dist(metadata: str, extra: str = "") -> list[Requirement]:
    """The ``Requires-Dist`` requirements of a METADATA text that apply here with ``extra`` requested.

    With ``extra=""`` that is the unconditional dependency set; an extra's own lines are those whose
    marker holds only with ``extra`` set. Markers are evaluated for this interpreter and platform.
    """
    env = dict(default_environment())
    out = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        try:
            req = Requirement(line.split(":", 1)[1].strip())
        except InvalidRequirement:
            continue
        if req.marker is None:
            if not extra:
                out.append(req)
            continue
        if req.marker.evaluate({**env, "extra": extra}) and (not extra or not req.marker.evaluate({**env, "extra": ""})):
            out.append(req)
    return out


def extra_pin(metadata: str, extra: str) -> str | None:
    """The version an ``ai-dynamo`` METADATA pins exactly for the engine of its ``extra`` (the extra and the
    distribution share the name: ``sglang[diffusion]==0.5.21``, ``vllm[flashinfer,otel,runai]==0.31.0``)."""
    for req in requires_dist(metadata, extra=extra):
        if canonicalize_name(req.name) == extra:
            exact = [sp.version for sp in req.specifier if sp.operator in ("==", "===") and "*" not in sp.version]
            if exact:
                return exact[0]
    return None


def shipped_sglang_from_metadata(metadata: str) -> str | None:
    """The SGLang version an ``ai-dynamo`` METADATA pins under its ``sglang`` extra (``sglang[diffusion]==0.5.21``)."""
    return extra_pin(metadata, "sglang")


def dynamo_metadata(dynamo: str, *, log: Callable[[str], None] = lambda _m: None) -> str:
    """The METADATA text of ``ai-dynamo==dynamo`` (installed into its release directory when needed)."""
    target = ensure_release("dynamo", dynamo, log=log)
    if target is None:
        import importlib.metadata as md

        return md.metadata("ai-dynamo").as_string()
    meta = _metadata_file(target, "ai-dynamo")
    if meta is None:
        raise MatrixError(f"ai-dynamo {dynamo} in {target} has no METADATA; remove the directory to reinstall it")
    return meta.read_text(encoding="utf-8", errors="replace")


def shipped_sglang(dynamo: str, *, log: Callable[[str], None] = lambda _m: None) -> str | None:
    """The SGLang release ``ai-dynamo[sglang]==dynamo`` pins, read from that release's installed wheel metadata."""
    return shipped_sglang_from_metadata(dynamo_metadata(dynamo, log=log))


def _target_versions(target: Path) -> dict[str, str]:
    versions = {}
    for meta in target.glob("*.dist-info/METADATA"):
        name = version = None
        for line in meta.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Name:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("Version:"):
                version = line.split(":", 1)[1].strip()
            elif not line.strip():
                break
        if name and version:
            versions[canonicalize_name(name)] = version
    return versions


def _satisfied(req: Requirement, version: str | None) -> bool:
    if version is None:
        return False
    try:
        return req.specifier.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def unsatisfied(target: Path, roots: Sequence[Requirement], environment: Callable[[str], str | None] = installed) -> list[Requirement]:
    """What ``roots`` and everything installed in ``target`` require that neither ``target`` nor the environment has.

    A requirement is met by the version in ``target`` when there is one (it comes first on the
    path), else by the environment's. Packages in :data:`ENVIRONMENT_ONLY` are never asked for.
    """
    have = _target_versions(target)
    wanted = list(roots)
    for meta in target.glob("*.dist-info/METADATA"):
        if _dist_name(meta) == "sglang":
            continue  # SGLang's own list is filtered into ``roots`` by the caller
        wanted += requires_dist(meta.read_text(encoding="utf-8", errors="replace"))
    missing: dict[str, Requirement] = {}
    for req in wanted:
        name = canonicalize_name(req.name)
        if name in ENVIRONMENT_ONLY or name in missing:
            continue
        if not _satisfied(req, have.get(name) or environment(name)):
            missing[name] = req
    return list(missing.values())


def sglang_roots(metadata: str, environment: Callable[[str], str | None] = installed) -> list[Requirement]:
    """The part of SGLang's dependency set a CPU environment must satisfy: its exact pins of
    :data:`SGLANG_COUPLED`, and every requirement on a package the environment has installed (the
    CUDA-only rest — flashinfer, sgl-kernel, … — is deliberately absent here and never imported)."""
    return [r for r in requires_dist(metadata)
            if canonicalize_name(r.name) not in ENVIRONMENT_ONLY
            and (canonicalize_name(r.name) in SGLANG_COUPLED or environment(canonicalize_name(r.name)) is not None)]


def _complete_dependencies(target: Path, log: Callable[[str], None]) -> None:
    meta = _metadata_file(target, "sglang")
    roots = sglang_roots(meta.read_text(encoding="utf-8", errors="replace")) if meta else []
    for _ in range(MAX_DEPENDENCY_ROUNDS):
        missing = unsatisfied(target, roots)
        if not missing:
            return
        log(f"  {target.name}: installing {', '.join(str(r.name) + str(r.specifier) for r in missing)}")
        _install(target, [f"{r.name}{r.specifier}" for r in missing])
    missing = unsatisfied(target, roots)
    if missing:
        raise MatrixError(f"{target.name}: dependencies still unsatisfied after {MAX_DEPENDENCY_ROUNDS} rounds: "
                          f"{', '.join(str(r) for r in missing)}")


def ensure_release(kind: str, version: str, *, log: Callable[[str], None] = lambda _m: None) -> Path | None:
    """The directory holding ``kind`` (``dynamo`` / ``sglang``) at ``version``; None = the running environment's.

    Installed once per version (a ``.complete`` marker naming :data:`INSTALL_SCHEME` makes the cache
    reusable; a lock makes concurrent runs safe); a cold cache downloads each wheel once.
    """
    dist = "ai-dynamo-runtime" if kind == "dynamo" else "sglang"
    build = local_build.find(kind, version)  # a pull request's own build, labelled like a release
    if build is None and installed(dist) == version and (kind == "sglang" or installed("ai-dynamo") == version):
        return None
    target = cache_root() / f"{'ai-dynamo' if kind == 'dynamo' else 'sglang'}-{version}"
    done = target / ".complete"
    if _complete(done):
        return target
    with locked(target):
        if _complete(done):
            return target
        log(f"installing {dist} {version} into {target}")
        start = time.perf_counter()
        if kind == "dynamo":
            if _metadata_file(target, "ai-dynamo") is None:
                _install(target, local_build.requirements(build) if build else
                            [f"{d}=={version}" for d in DYNAMO_PACKAGES])
        else:
            if _metadata_file(target, "sglang") is None:
                _install(target, local_build.requirements(build) if build else [f"sglang=={version}"])
            _complete_dependencies(target, log)
        done.write_text(f"scheme {INSTALL_SCHEME}\n{time.perf_counter() - start:.1f}s\n")
    return target


def _complete(done: Path) -> bool:
    try:
        return done.read_text().startswith(f"scheme {INSTALL_SCHEME}\n")
    except OSError:
        return False


@dataclass
class PairResult:
    """One pair's verdict, with the failing rows of its check as findings."""

    dynamo: str
    sglang: str
    verdict: str  # aligned | misaligned | error
    findings: list[dict[str, str]] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    shipped: bool = False  # sglang is the release ai-dynamo[sglang]==dynamo pins
    live: dict[str, Any] | None = None  # --live: the seed scenario on real CPU engines (see run_live)
    #: rows the pair's check could not run (a property this release cannot support), each with why: ``n/a``
    not_applicable: list[dict[str, str]] = field(default_factory=list)
    #: the KV-event formats the pair's check ran (its ``event_formats``); findings and n/a rows of the
    #: "dynamo" format say so in their ``event_format`` key
    event_formats: list[str] = field(default_factory=list)
    #: properties whose every row was n/a: not checked on this pair at all (never shown as aligned)
    not_run: list[str] = field(default_factory=list)
    #: rows whose mismatch did not recur on every replay of its example, with how often it did: shown, never a
    #: finding (kvalign.verify.confirm)
    unconfirmed: list[dict[str, str]] = field(default_factory=list)
    #: (property, mode) of every row the pair's check printed, in its order: another engine's table takes
    #: its columns from these (``matrix --engine vllm``); not in ``--json``, whose ``properties`` say it
    rows: list[tuple[str, str]] = field(default_factory=list, compare=False)

    def as_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"dynamo": self.dynamo, "sglang": self.sglang, "shipped": self.shipped,
                               "verdict": self.verdict, "findings": self.findings}
        if self.not_applicable:
            row["not_applicable"] = self.not_applicable
        if self.event_formats:
            row["event_formats"] = self.event_formats
        if self.not_run:
            row["not_run"] = self.not_run
        if self.unconfirmed:
            row["unconfirmed"] = self.unconfirmed
        if self.verdict == "error":
            row["error"] = one_line(self.error or "unknown error")
        if self.live is not None:
            row["live"] = self.live
        return row


def one_line(text: str) -> str:
    """The last non-empty line of an error text: a JSON row or a progress line carries one line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else text.strip()


class PairEnv(NamedTuple):
    """Where one pair runs: the interpreter of its environment and the environment variables."""

    python: str
    env: dict[str, str]


def pair_env(dynamo_dir: Path | None, sglang_dir: Path | None, sglang_version: str) -> PairEnv:
    """The pair's own environment (:func:`kvalign.releases.release_env.python_for`: its releases first, then
    this kvalign, then the running environment); the running interpreter for the installed pair."""
    dirs = [p for p in (dynamo_dir, sglang_dir) if p is not None]
    python = python_for(dirs) if dirs else sys.executable
    env = child_env() if dirs else dict(os.environ)
    # SGLang's event hash JIT-builds one C++ extension per version; keep it in the cache, not the venv.
    env["TORCH_EXTENSIONS_DIR"] = str(cache_root() / "torch-extensions" / f"sglang-{sglang_version}")
    env.setdefault("DYN_LOG", "error")
    return PairEnv(python, env)


def _run_check(cmd: Sequence[str], env: dict[str, str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    """Run one pair's check; one that overruns ``timeout`` (default ``PAIR_TIMEOUT_S``) is sent SIGABRT, then
    killed (MatrixError).

    A check that hangs (once seen in CI: nothing in its log after 900 s) would otherwise leave only
    "did not finish": with ``PYTHONFAULTHANDLER`` set, SIGABRT makes Python write every thread's
    stack to fd 2, which is the check's runtime log, and the error names that file.
    """
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**env, "PYTHONFAULTHANDLER": "1"}) as proc:
        try:
            limit = PAIR_TIMEOUT_S if timeout is None else timeout
            out, err = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                proc.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            logs = _check_logs(proc.pid)
            where = f"; its threads' stacks when it was stopped: {logs[-1]}" if logs else ""
            raise MatrixError(f"check did not finish within {limit:.0f}s{where}") from None
        if not any(line.startswith("{") for line in out.splitlines()):  # no report: did it deadlock?
            stuck = _stuck_log(proc.pid)
            if stuck is not None:
                raise RuntimeDeadlock(f"the check's in-process Dynamo runtime deadlocked (no call came back within "
                                      f"{STUCK_EXIT_S:.0f}s); its threads' stacks: {stuck}")
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class RuntimeDeadlock(MatrixError):
    """A pair's check exited through the router path's deadlock watchdog (``STUCK_EXIT_S``)."""


def _check_logs(pid: int) -> list[Path]:
    """The runtime logs of the check process ``pid`` (:mod:`kvalign.runtime_log` names them by pid)."""
    return sorted(log_dir().glob(f"check-*-{pid}.log"))


def _stuck_log(pid: int) -> Path | None:
    """The check's runtime log when faulthandler's watchdog wrote it (the process deadlocked)."""
    for log in _check_logs(pid):
        try:
            if STUCK_MARK in log.read_text(errors="replace"):
                return log
        except OSError:
            continue
    return None


def _format_key(row: dict[str, Any]) -> dict[str, str]:
    """``{"event_format": "dynamo"}`` for a row of SGLang's dynamo event format, else nothing (the
    default format's rows keep the keys they always had)."""
    return {"event_format": "dynamo"} if row.get("event_format") == "dynamo" else {}


def run_pair(dynamo: str, sglang: str, *, examples: int, ingest_examples: int, props: Sequence[str] | None = None,
             log: Callable[[str], None] = lambda _m: None, event_format: str = "both") -> PairResult:
    """Install (if needed) and check one pair in a subprocess (only ``props`` when given)."""
    start = time.perf_counter()
    try:
        python, env = pair_env(ensure_release("dynamo", dynamo, log=log), ensure_release("sglang", sglang, log=log), sglang)
    except (MatrixError, ReleaseEnvError, subprocess.TimeoutExpired, OSError) as exc:
        return PairResult(dynamo, sglang, "error", error=str(exc), seconds=time.perf_counter() - start)
    cmd = [python, "-m", "kvalign", "check", "--json", "--examples", str(examples), "--event-format", event_format,
           "--ingest-examples", str(ingest_examples), *(a for p in props or () for a in ("--property", p))]
    try:
        try:
            res = _run_check(cmd, env)
        except RuntimeDeadlock as exc:  # intermittent (1.0.2's KvRouter constructor): the pair gets one more run
            log(f"  {dynamo} x {sglang}: {exc}; running its check once more")
            res = _run_check(cmd, env)
    except MatrixError as exc:
        return PairResult(dynamo, sglang, "error", error=str(exc), seconds=time.perf_counter() - start)
    return check_result(dynamo, sglang, res, time.perf_counter() - start)


def check_result(dynamo: str, sglang: str, res: subprocess.CompletedProcess[str], seconds: float) -> PairResult:
    """A pair's row from its finished ``check --json`` process (``sglang``: the engine release's version, SGLang's
    or vLLM's): an error row, with check's last stderr line, where it exited 2 or printed no report."""
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
        # a traceback's last line is its exception; a search's report may follow it (Hypothesis's failing case)
        raised = [ln for ln in err if re.match(r"^[\w.]*(Error|Exception)\b[^:]*: ", ln)]
        err = raised or err
        return PairResult(dynamo, sglang, "error", seconds=seconds,
                          error=f"check exited {res.returncode} without a JSON report" + (f": {err[-1]}" if err else ""))
    return pair_result(dynamo, sglang, report, seconds)


def pair_result(dynamo: str, sglang: str, report: dict[str, Any], seconds: float = 0.0) -> PairResult:
    """A pair's row from its ``check --json`` report: the failing rows as findings, the skipped ones n/a."""
    failed = [r for r in report["rows"] if (r["mismatches"] or r.get("unconfirmed")) and not r.get("skipped")]
    findings = [{"property": r["prop"], "mode": r["mode"], "variant": r["variant"], "cause": r["cause_name"] or "UNKNOWN",
                 "detail": r["detail"] or "", "class": r.get("class") or cause_class(r["cause_name"] or "UNKNOWN"),
                 **_format_key(r)} for r in failed if not r.get("unconfirmed")]
    unconfirmed = [{"property": r["prop"], "mode": r["mode"], "variant": r["variant"], "cause": r["cause_name"] or "UNKNOWN",
                    "detail": r["detail"] or "", "rate": r["unconfirmed"], **_format_key(r)}
                   for r in failed if r.get("unconfirmed")]
    not_applicable = [{"property": r["prop"], "mode": r["mode"], "variant": r["variant"], "reason": r["skipped"],
                       **_format_key(r)} for r in report["rows"] if r.get("skipped")]
    # misaligned only on a cache-blind finding, as check's own exit status; credit skews are advisories
    verdict = "misaligned" if any(f["class"] == CACHE_BLIND for f in findings) else "aligned"
    ran = {r["prop"] for r in report["rows"] if not r.get("skipped")}
    not_run = sorted({r["prop"] for r in report["rows"]} - ran)
    return PairResult(dynamo, sglang, verdict, findings, seconds=seconds, not_applicable=not_applicable,
                      event_formats=list(report.get("event_formats") or []), not_run=not_run, unconfirmed=unconfirmed,
                      rows=list(dict.fromkeys((r["prop"], r["mode"]) for r in report["rows"])))


@dataclass(frozen=True)
class Pair:
    """One release pair to check; ``shipped`` when ``sglang`` is the one ``ai-dynamo[sglang]==dynamo`` pins."""

    dynamo: str
    sglang: str
    shipped: bool = False


def plan_pairs(dynamo: Sequence[str], sglang: Sequence[str], *, shipped: bool,
               pinned: Callable[[str], str | None], engine: str = "sglang") -> tuple[list[Pair], dict[str, str]]:
    """The cross product ``dynamo x sglang`` plus, when ``shipped``, each Dynamo release's own SGLang.

    ``pinned(d)`` answers the shipped SGLang (or ``engine``'s release) of ``d`` (None: the wheel pins none) or raises
    :class:`MatrixError`; the second value maps a Dynamo release whose pin could not be read to why
    (only when ``shipped``). A shipped pair is marked wherever it appears, also in a plain cross
    product; with ``shipped`` it is added when missing.
    """
    pins: dict[str, str] = {}
    unknown: dict[str, str] = {}
    for d in dynamo:
        try:
            pin = pinned(d)
        except MatrixError as exc:
            if shipped:  # otherwise the pair's own install reports it
                unknown[d] = one_line(str(exc))
            continue
        if pin is not None:
            pins[d] = pin
        elif shipped:
            unknown[d] = f"ai-dynamo {d} pins no {engine} release under its [{engine}] extra"
    pairs = []
    for d in dynamo:
        versions = list(sglang)
        if shipped and d in pins and pins[d] not in versions:
            versions.append(pins[d])
        pairs += [Pair(d, s, pins.get(d) == s) for s in sorted(versions, key=_version_key)]
    return pairs, unknown


def run_matrix(pairs: Sequence[Pair], *, examples: int, ingest_examples: int, jobs: int = 1,
               props: Sequence[str] | None = None, progress: Callable[[PairResult, int, int], None] | None = None,
               log: Callable[[str], None] = lambda _m: None, event_format: str = "both") -> list[PairResult]:
    """Every pair, ``jobs`` at a time; results in the order given, progress as pairs finish."""
    # Install every release first, one at a time (pip and the disk are the bottleneck, not the CPU).
    for kind, versions in (("dynamo", [p.dynamo for p in pairs]), ("sglang", [p.sglang for p in pairs])):
        for v in dict.fromkeys(versions):
            try:
                ensure_release(kind, v, log=log)
            except MatrixError:
                pass  # reported by the pairs that need it
    return run_pairs(pairs, lambda p: run_pair(p.dynamo, p.sglang, examples=examples, ingest_examples=ingest_examples,
                                               props=props, log=log, event_format=event_format), jobs, progress)


def run_pairs(pairs: Sequence[Pair], run_one: Callable[[Pair], PairResult], jobs: int,
              progress: Callable[[PairResult, int, int], None] | None) -> list[PairResult]:
    """``run_one`` on every pair, ``jobs`` at a time (either engine's matrix): results in the order given, progress
    as pairs finish."""
    results: dict[Pair, PairResult] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(run_one, p): p for p in pairs}
        for fut in as_completed(futures):
            pair = futures[fut]
            results[pair] = fut.result()
            results[pair].shipped = pair.shipped
            if progress:
                progress(results[pair], len(results), len(pairs))
    return [results[p] for p in pairs]


def live_problem(dynamo: str, sglang: str) -> str | None:
    """Why the live scenario cannot run for this pair here (None when it can).

    On the environment's Dynamo the live layer runs the real SGLang engine (``dynamo.sglang``
    workers) on any SGLang release the CPU stand-in supports, from the wheel cache. Another Dynamo
    release runs every process from its own wheel-cache directory with kvalign's fake workers
    (``e2e run --engine fake-cpu --dynamo``), whose pages are keyed by the environment's SGLang
    radix cache: so only beside that SGLang."""
    from kvalign.standins.sglang_cpu import version_problem

    if dynamo == installed("ai-dynamo"):
        return version_problem(sglang)
    env_sglang = installed("sglang")
    if sglang != env_sglang:
        return (f"Dynamo {dynamo} runs live with kvalign's fake workers, which key pages with the environment's "
                f"SGLang ({env_sglang}); its own dynamo.sglang imports only beside its own SGLang release")
    return None


def live_command(dynamo: str, sglang: str) -> list[str]:
    """The ``kvalign e2e run`` that checks one pair live (see :func:`live_problem`)."""
    if dynamo == installed("ai-dynamo"):
        return ["e2e", "run", "--engine", "sglang-cpu", "--sglang", sglang]
    return ["e2e", "run", "--engine", "fake-cpu", "--dynamo", dynamo, "--bind-host", "127.0.0.1"]


def run_live(dynamo: str, sglang: str, *, log: Callable[[str], None] = lambda _m: None) -> dict[str, Any]:
    """The seed scenario (:func:`live_command`) for one pair, in a subprocess:
    ``{"verdict": "pass"|"fail"|"skipped"|"error", "detail": one line, "seconds": wall}``."""
    problem = live_problem(dynamo, sglang)
    if problem:
        return {"verdict": "skipped", "detail": problem, "seconds": 0.0}
    start = time.perf_counter()
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, "-m", "kvalign", *live_command(dynamo, sglang)]
    log(f"live: dynamo {dynamo} x sglang {sglang}: {' '.join(cmd[1:])}")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=LIVE_TIMEOUT_S, cwd=root)
    except subprocess.TimeoutExpired:
        return {"verdict": "error", "detail": f"did not finish within {LIVE_TIMEOUT_S}s",
                "seconds": round(time.perf_counter() - start, 1)}
    seconds = round(time.perf_counter() - start, 1)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
    if res.returncode == 0 and lines and lines[-1].startswith("PASS"):
        return {"verdict": "pass", "detail": lines[-1], "seconds": seconds}
    if res.returncode == 1 and lines:
        return {"verdict": "fail", "detail": "; ".join(lines), "seconds": seconds}
    return {"verdict": "error", "detail": one_line(res.stderr or f"exit {res.returncode}"), "seconds": seconds}


def _cause(f: dict[str, str]) -> str:
    """A finding's cause, with its class where it is not cache-blind (a credit skew: an advisory, not a failure)."""
    klass = f.get("class") or cause_class(f["cause"])
    return f["cause"] if klass == CACHE_BLIND else f"{f['cause']} ({klass})"


def _cell(findings: Sequence[dict[str, str]], not_applicable: Sequence[dict[str, str]] = (),
          unconfirmed: Sequence[dict[str, str]] = ()) -> str:
    """``ok``, or the causes found (a credit skew says so), then ``n/a`` when a variant could not run (never a
    bare ``ok`` then), then ``unconfirmed`` when a variant's mismatch did not recur on every replay."""
    parts = [*dict.fromkeys(_cause(f) for f in findings), *(["n/a"] if not_applicable else []),
             *(["unconfirmed"] if unconfirmed else [])]
    return ", ".join(parts) if parts else "ok"


def shown_verdict(r: PairResult) -> str:
    """The verdict as the table and markdown show it: ``aligned`` only where every property ran somewhere
    (a property whose every row was n/a is named: it was not checked), with the advisories counted."""
    if r.verdict == "error":
        return r.verdict
    skews = sum((f.get("class") or cause_class(f["cause"])) == CREDIT_SKEW for f in r.findings)
    notes = ["credit-skew advisory"] * bool(skews) + [f"not run: {', '.join(r.not_run)}"] * bool(r.not_run)
    return r.verdict + (f" ({'; '.join(notes)})" if notes else "")


def _dynamo_format_cell(r: PairResult, props: Sequence[str]) -> str:
    """The dynamo-format column: ``-`` where the check did not run it (or no property that reads
    events), ``n/a`` where this SGLang has no such format, else ``ok`` or the causes of its rows."""
    if "dynamo" not in r.event_formats or not set(props) & set(registry.event_names()):
        return "-"
    findings = [f for f in r.findings if f.get("event_format") == "dynamo"]
    not_applicable = [n for n in r.not_applicable if n.get("event_format") == "dynamo"]
    if not_applicable and not findings and all("KV-event format" in n["reason"] for n in not_applicable):
        return "n/a"
    return _cell(findings, not_applicable)


def table(results: Sequence[PairResult], props: Sequence[str] | None = None, modes: Sequence[str] = MODES, *,
          engine: str = "sglang", columns: Sequence[tuple[str, str]] | None = None) -> str:
    """One row per pair, one column per property x mode (the modes a property runs in); a cell is ``ok``
    or the causes found, in SGLang's default event format.

    A pair whose SGLang is the one its Dynamo release pins says ``(shipped)`` after the version; where
    a check ran SGLang's "dynamo" event format too, a column gives those rows' causes (``n/a`` where
    the release has no such format); with ``--live`` rows, a last column gives the live scenario's verdict.
    ``engine`` names the second release's column (``vllm``: :mod:`kvalign.verify.report.matrix_vllm`), and
    ``columns`` gives the (property, mode) columns where they are not the registry's (vLLM's rows)."""
    live = any(r.live is not None for r in results)
    fmt = any("dynamo" in r.event_formats for r in results)
    props = registry.default_names() if props is None else props
    known = registry.by_name()
    if columns is None:
        columns = [(p, m) for p in props for m in modes if p not in known or m in known[p].modes]
    head = ["dynamo", engine, "verdict", *[f"{p}:{m}" for p, m in columns], *([FORMAT_COLUMN] if fmt else []),
            *([LIVE_COLUMN] if live else [])]
    body = []
    for r in results:
        default = [f for f in r.findings if f.get("event_format") != "dynamo"]
        default_na = [n for n in r.not_applicable if n.get("event_format") != "dynamo"]
        if r.verdict == "error":
            cells = ["error"] * (len(head) - 3 - live)
        else:
            cells = [_cell([f for f in default if f["property"] == p and f["mode"] == m],
                           [n for n in default_na if n["property"] == p and n["mode"] == m],
                           [u for u in r.unconfirmed if u["property"] == p and u["mode"] == m
                            and u.get("event_format") != "dynamo"])
                     for p, m in columns]
            if fmt:
                cells.append(_dynamo_format_cell(r, props))
        if live:
            cells.append((r.live or {}).get("verdict", "-"))
        body.append([r.dynamo, r.sglang + (" (shipped)" if r.shipped else ""), shown_verdict(r), *cells])
    widths = [max(len(row[i]) for row in (head, *body)) for i in range(len(head))]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


# ---- cells: one pair per CI job, merged into the one-run table ---------------------------------

#: ``"format"`` of the JSON that ``kvalign matrix --cell D:S --json`` prints (one row plus its plan).
CELL_FORMAT = "kvalign-matrix-cell/1"
#: The SGLang of a cell whose Dynamo release's shipped pin could not be read (an error row).
UNKNOWN = "unknown"
VERDICTS = ("aligned", "misaligned", "error")
FINDING_KEYS = ("property", "mode", "variant", "cause", "detail")
NOT_APPLICABLE_KEYS = ("property", "mode", "variant", "reason")
UNCONFIRMED_KEYS = ("property", "mode", "variant", "cause", "detail", "rate")
#: A key findings and n/a rows carry only when they are rows of SGLang's "dynamo" event format.
OPTIONAL_KEYS = ("event_format", "class")


class CellFileError(ValueError):
    """A cell file that cannot be merged (malformed, duplicate, or from another plan/environment)."""


def cell_id(dynamo: str, sglang: str) -> str:
    return f"{dynamo}:{sglang}"


def list_cells(pairs: Sequence[Pair], unknown: dict[str, str]) -> list[dict[str, Any]]:
    """The cells one ``matrix`` run over ``pairs`` checks, in its row order; a Dynamo release whose
    shipped SGLang is unknown is a cell ``D:unknown`` (its ``--cell`` run gives the same error row)."""
    cells = [{"cell": cell_id(p.dynamo, p.sglang), "dynamo": p.dynamo, "sglang": p.sglang, "shipped": p.shipped}
             for p in pairs]
    cells += [{"cell": cell_id(d, UNKNOWN), "dynamo": d, "sglang": UNKNOWN, "shipped": True, "error": why}
              for d, why in unknown.items()]
    return cells


def unknown_result(dynamo: str, why: str) -> PairResult:
    """The row of a Dynamo release whose shipped SGLang could not be read (as one run reports it)."""
    return PairResult(dynamo, UNKNOWN, "error", error=f"shipped SGLang unknown: {why}", shipped=True)


def report_json(results: Sequence[PairResult], versions: dict[str, Any],
                props: Sequence[str] | None = None) -> dict[str, Any]:
    """``matrix --json``'s document; ``properties`` says which were checked (a row's empty findings
    mean aligned on those only)."""
    checked = registry.default_names() if props is None else props
    return {"versions": versions, "properties": list(checked), "scope": scope_of(checked).as_json(),
            "rows": [r.as_json() for r in results]}


def scope_of(props: Sequence[str] | None, engine: str = "sglang") -> Scope:
    """What a run's verdicts speak for: the properties of ``engine`` it checked (None: its default ones) against
    those it left out."""
    return Scope.of(registry.of_engine(engine), registry.default_names(engine) if props is None else props)


def scope_line(props: Sequence[str] | None, engine: str = "sglang") -> str | None:
    """Under a table: the verdicts are for deployments without what did not run (None: everything ran)."""
    scope = scope_of(props, engine)
    if scope.complete:
        return None
    return f"Verdicts for {scope.aligned_for()}; {scope.not_run_line()}."


def render(results: Sequence[PairResult], props: Sequence[str] | None = None, *, engine: str = "sglang",
           columns: Sequence[tuple[str, str]] | None = None, scope: str | None = None) -> str:
    """``matrix``'s stdout without ``--json``: the table (a column per checked property x mode),
    then one line per error row (``engine``, ``columns``, ``scope``: another engine's table and scope line)."""
    out = [table(results, props, engine=engine, columns=columns)]
    line = scope if engine != "sglang" else scope_line(props)
    out += [f"\n{line}"] if line else []
    out += [f"\n{r.dynamo} x {r.sglang}: error: {one_line(r.error or 'unknown error')}"
            for r in results if r.verdict == "error"]
    for r in results:
        reasons: dict[str, list[str]] = {}
        for n in r.not_applicable:
            reasons.setdefault(n["reason"], []).append(f"{n['property']}:{n['mode']}")
        out += [f"\n{r.dynamo} x {r.sglang}: n/a {', '.join(dict.fromkeys(cells))}: {why}" for why, cells in reasons.items()]
        out += [f"\n{r.dynamo} x {r.sglang}: unconfirmed (not a finding) {u['property']}:{u['mode']}:{u['variant']} "
                f"{u['cause']}, {u['rate']}" for u in r.unconfirmed]
    return "\n".join(out)


def _markdown_causes(r: PairResult) -> str:
    """A pair's causes, each with the properties it was found in, then the properties that could not run."""
    if r.verdict == "error":
        return f"error: {one_line(r.error or 'unknown error')}".replace("|", "\\|")
    where: dict[str, list[str]] = {}
    for f in r.findings:
        where.setdefault(f["cause"], [])
        if f["property"] not in where[f["cause"]]:
            where[f["cause"]].append(f["property"])
    classes = {f["cause"]: f.get("class") or cause_class(f["cause"]) for f in r.findings}

    def notes(cause: str) -> str:
        out = [] if classes[cause] == CACHE_BLIND else [classes[cause]]
        if live_run(cause, r.dynamo, r.sglang) is not None:
            out.append(LIVE_MARK)  # from its recorded run; a cause without the mark was not reproduced live
        return "".join(f"; {n}" for n in out)

    parts = [f"{cause} ({', '.join(props)}{notes(cause)})" for cause, props in where.items()]
    na = _markdown_not_applicable([n for n in r.not_applicable if n.get("event_format") != "dynamo"])
    dynamo_na = [n for n in r.not_applicable if n.get("event_format") == "dynamo"]
    if dynamo_na and all("KV-event format" in n["reason"] for n in dynamo_na):
        na.append("dynamo event format")  # this SGLang has no such format: one entry, not every event property
    else:
        na += [f"{p} [dynamo]" for p in _markdown_not_applicable(dynamo_na)]
    return "; ".join([", ".join(parts)] * bool(parts) + ([f"n/a: {', '.join(na)}"] if na else [])) or "-"


def _markdown_not_applicable(rows: Sequence[dict[str, str]]) -> list[str]:
    """The properties that could not run, a property named alone where it could not run at all (its
    ``base`` row, or several of its rows, n/a), else with the one variant that could not run: a
    property whose other rows ran is not called n/a as a whole."""
    by_prop: dict[str, list[str]] = {}
    for n in rows:
        by_prop.setdefault(n["property"], [])
        if n["variant"] not in by_prop[n["property"]]:
            by_prop[n["property"]].append(n["variant"])
    return [p if "base" in variants or len(variants) > 1 else f"{p} ({variants[0]})" for p, variants in by_prop.items()]


def render_markdown(results: Sequence[PairResult], command: str, props: Sequence[str] | None = None, *,
                    engine: str = "sglang", scope: str | None = None) -> str:
    """``matrix --markdown``: a row per pair (``(shipped)`` in bold: the pair a deployment of that Dynamo
    runs), the causes found with the properties that found them and ``n/a`` with the properties that
    could not run (the table without ``--markdown`` says why, a line per reason), and under it the one
    command that reproduces it."""
    out = [f"| dynamo | {engine} | verdict | causes (properties) |", "|---|---|---|---|"]
    for r in results:
        sglang = f"**{r.sglang} (shipped)**" if r.shipped else r.sglang
        live = f"; live: {r.live.get('verdict', '-')}" if r.live is not None else ""
        out.append(f"| {r.dynamo} | {sglang} | {shown_verdict(r)} | {_markdown_causes(r)}{live} |")
    line = scope if engine != "sglang" else scope_line(props)
    return "\n".join([*out, *(["", line] if line else []), "", f"`{command}`"])


def exit_code(results: Sequence[PairResult]) -> int:
    """0 all aligned, 1 any misaligned (or a live scenario failed), 2 any error."""
    if any(r.verdict == "error" or (r.live or {}).get("verdict") == "error" for r in results):
        return 2
    return 1 if any(r.verdict == "misaligned" or (r.live or {}).get("verdict") == "fail" for r in results) else 0


def cell_document(result: PairResult, versions: dict[str, Any], plan: dict[str, Any],
                  props: Sequence[str] | None = None) -> dict[str, Any]:
    """``--cell --json``: the matrix's own document for that one row, plus what a merge needs
    (the cell, and the plan it belongs to: the ``--dynamo``/``--sglang``/``--shipped`` options and
    the example counts; cells of different plans do not merge)."""
    return {**report_json([result], versions, props), "format": CELL_FORMAT,
            "cell": {"cell": cell_id(result.dynamo, result.sglang), "plan": plan}}


def result_from_row(row: Any) -> PairResult:
    """The :class:`PairResult` a ``--json`` row was printed from (:meth:`PairResult.as_json` inverted);
    ValueError names what is wrong with a row that no run prints."""
    if not isinstance(row, dict):
        raise ValueError("a row is not a JSON object")
    for key in ("dynamo", "sglang", "verdict"):
        if not isinstance(row.get(key), str) or not row[key]:
            raise ValueError(f"row has no {key!r} string")
    if row["verdict"] not in VERDICTS:
        raise ValueError(f"row verdict {row['verdict']!r} is not one of {', '.join(VERDICTS)}")
    if not isinstance(row.get("shipped"), bool):
        raise ValueError("row has no 'shipped' true/false")
    findings = row.get("findings")
    if not isinstance(findings, list) or not all(
            isinstance(f, dict) and set(FINDING_KEYS) <= set(f) <= {*FINDING_KEYS, *OPTIONAL_KEYS}
            and all(isinstance(v, str) for v in f.values())
            for f in findings):
        raise ValueError(f"row 'findings' is not a list of {{{', '.join(FINDING_KEYS)}}} string objects")
    if (row["verdict"] == "error") != isinstance(row.get("error"), str):
        raise ValueError("row has an 'error' string exactly when its verdict is error, and this one does not")
    live = row.get("live")
    if live is not None and not (isinstance(live, dict) and isinstance(live.get("verdict"), str)):
        raise ValueError("row 'live' is not an object with a 'verdict'")
    not_applicable = row.get("not_applicable", [])
    well_formed = isinstance(not_applicable, list) and all(
        isinstance(n, dict) and set(NOT_APPLICABLE_KEYS) <= set(n) <= {*NOT_APPLICABLE_KEYS, *OPTIONAL_KEYS}
        and all(isinstance(v, str) for v in n.values())
        for n in not_applicable)
    if not well_formed or ("not_applicable" in row and not not_applicable):  # a run prints the key only when non-empty
        raise ValueError(f"row 'not_applicable' is not a non-empty list of {{{', '.join(NOT_APPLICABLE_KEYS)}}} "
                         "string objects")
    formats = row.get("event_formats", [])
    if not isinstance(formats, list) or not all(isinstance(f, str) for f in formats):
        raise ValueError("row 'event_formats' is not a list of strings")
    not_run = row.get("not_run", [])
    if not isinstance(not_run, list) or not all(isinstance(p, str) for p in not_run):
        raise ValueError("row 'not_run' is not a list of property names")
    unconfirmed = row.get("unconfirmed", [])
    if not isinstance(unconfirmed, list) or not all(
            isinstance(u, dict) and set(UNCONFIRMED_KEYS) <= set(u) <= {*UNCONFIRMED_KEYS, *OPTIONAL_KEYS}
            and all(isinstance(v, str) for v in u.values()) for u in unconfirmed):
        raise ValueError(f"row 'unconfirmed' is not a list of {{{', '.join(UNCONFIRMED_KEYS)}}} string objects")
    extra = set(row) - {"dynamo", "sglang", "shipped", "verdict", "findings", "not_applicable", "error", "live",
                        "event_formats", "not_run", "unconfirmed"}
    if extra:
        raise ValueError(f"row has unknown keys {sorted(extra)}")
    return PairResult(row["dynamo"], row["sglang"], row["verdict"], list(findings), error=row.get("error"),
                      shipped=row["shipped"], live=live, not_applicable=list(not_applicable), event_formats=list(formats),
                      not_run=list(not_run), unconfirmed=list(unconfirmed))


def _plan_order(plan: dict[str, Any], r: PairResult) -> tuple[Any, ...]:
    """Where one run over ``plan`` puts row ``r``: Dynamo releases in ``--dynamo`` order (the default
    list is sorted), each one's SGLang releases sorted; the unknown-pin rows last (see plan_pairs)."""
    dynamo = plan.get("dynamo")
    where = dynamo.index(r.dynamo) if dynamo and r.dynamo in dynamo else _version_key(r.dynamo)
    if r.sglang == UNKNOWN:
        return (1, where, ())
    return (0, where, _version_key(r.sglang))


#: The error of a planned cell that has no result file: its row in the merged table says this.
NO_RESULT = "no result: this cell's job wrote none (it died, timed out or was cancelled before its result)"


def planned_cells(name: str, doc: Any) -> list[dict[str, Any]]:
    """The cells of a ``--list-cells --json`` document (``name`` is its file, for the error line)."""
    if not isinstance(doc, list) or not all(
            isinstance(c, dict) and all(isinstance(c.get(k), str) and c[k] for k in ("cell", "dynamo", "sglang"))
            and c["cell"] == cell_id(c["dynamo"], c["sglang"]) for c in doc):
        raise CellFileError(f"{name}: not a list of planned cells (write it with kvalign matrix --list-cells --json)")
    ids = [c["cell"] for c in doc]
    twice = sorted({c for c in ids if ids.count(c) > 1})
    if twice:
        raise CellFileError(f"{name}: planned cells listed twice: {', '.join(twice)}")
    return list(doc)


def missing_result(cell: dict[str, Any]) -> PairResult:
    """The row of a planned cell without a result: an error, so the merged table keeps every row and exits 2."""
    return PairResult(cell["dynamo"], cell["sglang"], "error", error=NO_RESULT, shipped=bool(cell.get("shipped")))


def merge_planned(docs: Sequence[tuple[str, Any]], planned: Sequence[dict[str, Any]],
                  planned_name: str) -> tuple[dict[str, Any], list[PairResult], list[str]]:
    """:func:`merge_cells` held to the planned cells: (versions, every planned cell's row in the planned
    order, the ids of the cells that had no result). A planned cell without a result file is an error
    row (:data:`NO_RESULT`); a result of a cell that was not planned is a :class:`CellFileError`."""
    versions, results = merge_cells(docs) if docs else ({}, [])
    order = {c["cell"]: i for i, c in enumerate(planned)}
    found = {cell_id(r.dynamo, r.sglang): r for r in results}
    stray = [c for c in found if c not in order]
    if stray:
        raise CellFileError(f"{planned_name}: results for cells it does not plan: {', '.join(stray)} "
                            "(list the cells with the options the cells ran with)")
    missing = [c["cell"] for c in planned if c["cell"] not in found]
    rows = [found.get(c["cell"]) or missing_result(c) for c in planned]
    return versions, rows, missing


def merge_cells(docs: Sequence[tuple[str, Any]]) -> tuple[dict[str, Any], list[PairResult]]:
    """The ``versions`` and rows, in one run's order, of the cell documents ``(name, parsed JSON)``.

    Raises :class:`CellFileError` (one line naming the file) for a document that is not a cell,
    a cell given twice, or cells whose plan or environment versions differ."""
    seen: dict[str, str] = {}
    first: tuple[str, dict[str, Any], dict[str, Any]] | None = None
    results: list[PairResult] = []
    for name, doc in docs:
        if not isinstance(doc, dict) or doc.get("format") != CELL_FORMAT:
            raise CellFileError(f"{name}: not a kvalign matrix cell (no \"format\": \"{CELL_FORMAT}\"; "
                                "write it with kvalign matrix --cell DYNAMO:SGLANG --json)")
        cell, rows, versions = doc.get("cell"), doc.get("rows"), doc.get("versions")
        if not isinstance(cell, dict) or not isinstance(cell.get("cell"), str) or not isinstance(cell.get("plan"), dict):
            raise CellFileError(f"{name}: malformed cell: no \"cell\" object with its id and plan")
        if not isinstance(versions, dict):
            raise CellFileError(f"{name}: malformed cell: no \"versions\" object")
        if not isinstance(rows, list) or len(rows) != 1:
            raise CellFileError(f"{name}: malformed cell: \"rows\" must hold exactly one row")
        try:
            result = result_from_row(rows[0])
        except ValueError as exc:
            raise CellFileError(f"{name}: malformed cell: {exc}") from None
        if cell["cell"] != cell_id(result.dynamo, result.sglang) and not (
                cell["cell"] == cell_id(result.dynamo, UNKNOWN)):
            raise CellFileError(f"{name}: malformed cell: cell {cell['cell']!r} holds the row of "
                                f"{cell_id(result.dynamo, result.sglang)!r}")
        key = cell_id(result.dynamo, result.sglang)
        if key in seen:
            raise CellFileError(f"{name}: duplicate cell {key} (also in {seen[key]})")
        seen[key] = name
        if first is None:
            first = (name, cell["plan"], versions)
        elif cell["plan"] != first[1]:
            raise CellFileError(f"{name}: mismatched cell: its plan {json.dumps(cell['plan'], sort_keys=True)} is not "
                                f"{first[0]}'s {json.dumps(first[1], sort_keys=True)}")
        elif versions != first[2]:
            raise CellFileError(f"{name}: mismatched cell: it ran with versions {json.dumps(versions, sort_keys=True)}, "
                                f"{first[0]} with {json.dumps(first[2], sort_keys=True)}")
        results.append(result)
    if first is None:
        raise CellFileError("no cell files to merge")
    plan = first[1]
    return first[2], sorted(results, key=lambda r: _plan_order(plan, r))
