"""``kvalign matrix --engine vllm``'s engine: ``kvalign check --engine vllm`` for every Dynamo x vLLM release pair.

The pairs people deploy are each Dynamo release with the vLLM its ``ai-dynamo[vllm]`` extra pins
(:func:`shipped_vllm`, read from the release's own wheel METADATA as the SGLang pin is). Each vLLM
release is the vLLM project's official wheel (a CUDA build), installed ``--no-deps`` with the
pure-Python packages its prefix-cache import chain needs into a directory of its own
(:func:`kvalign.releases.vllm_env.ensure`); its ``KVCacheManager``, block hasher and
``ZmqEventPublisher`` import on CPU without the compiled extension, on kvalign's torch. Before a
release's pairs run, :func:`probe` imports that code there and asks the distribution's version: a
release that does not install or import is an error row naming it, never a crash and never rows
run on another vLLM.

A pair's check runs in the Dynamo release's environment (the SGLang matrix's, relay and router from
that release) with :data:`~kvalign.releases.vllm_env.RELEASE_ENV` naming the vLLM release, so the
vLLM oracle's process runs that release. The rows are whatever ``check --engine vllm`` prints
(:mod:`kvalign.verify.props.vllm`): a row added there is a column here. A row that cannot run on a
release (its relay API differs, its vLLM lacks a field) is ``n/a`` with check's reason, never a finding.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvalign.releases.release_env import ReleaseEnvError, child_env, python_for
from kvalign.releases.vllm_env import OFFICIAL_DIST, RELEASE_ENV, ensure
from kvalign.verify import props as registry
from kvalign.verify.report.matrix import (MatrixError, Pair, PairResult, _run_check, check_result, dynamo_metadata,
                                          ensure_release, extra_pin, one_line, run_pairs, scope_of)

ENGINE = "vllm"
#: vLLM releases a matrix without ``--vllm`` checks (beside each Dynamo release's shipped one): the newest.
DEFAULT_VLLM = ("0.33.0",)
#: ``--vllm-examples`` per pair when ``--examples`` is not given (the SGLang matrix likewise runs fewer cases
#: than ``check``): most of a pair's time is fixed (a vLLM worker per row group, each control's own
#: ``CONTROL_EXAMPLES``), so 5 generated cases per row keep the README's four pairs near 10 minutes on 2 cores.
EXAMPLES = 5
#: Seconds one pair's ``check --engine vllm`` may take: its fifteen rows took 44-88 s per 1.6.1 / 1.5.1 pair at
#: 5 examples, one pair at a time at load 7-9, but 634 s for 1.3.1 x 0.23.0 at load ~15 beside other pairs.
PAIR_TIMEOUT_S = 1800
#: Pairs checked at once when ``--jobs`` is not given: one. A Dynamo 1.6.1 pair's check holds up to 80 inotify
#: instances at once (its routers' file-discovery watches; measured), and Linux allows 128 per user by default
#: (``fs.inotify.max_user_instances``): two such checks at once failed with "Internal filesystem error: Too many
#: open files (os error 24)" in both runs of the README's table. One at a time, the four pairs take about as long
#: on two cores (each pair is CPU-bound).
JOBS = 1
#: A pair's verdict where kvalign's vLLM oracle does not drive its vLLM release: no row ran, so it counts
#: toward nothing (exit status 0 as for an aligned pair), never an error row and never a finding.
NOT_APPLICABLE = "n/a"
#: vLLM releases the oracle does not drive, and why (read in each release's source; both hold for 0.16.0, the
#: release Dynamo 1.0.2's ``vllm`` extra pins).
NOT_DRIVEN = {"0.16.0": "vLLM 0.16.0's KVCacheManager takes no scheduler_block_size (kvalign's vLLM oracle drives "
                        "the API of 0.23.0 and later) and its import needs diskcache"}
#: Seconds a release's import probe may take (vLLM's first import compiles its modules: 30-90 s here).
PROBE_TIMEOUT_S = 600
#: What :func:`probe` runs in a release's interpreter: the oracle's own import of vLLM's prefix-cache code and
#: a cache built as the oracle builds it, then the version of the distribution that answered.
PROBE = ("import importlib.metadata as md; from kvalign.oracles.vllm_cache import VllmCache; VllmCache(16, 10).close(); "
         f"print(md.version({OFFICIAL_DIST!r}))")


def shipped_vllm_from_metadata(metadata: str) -> str | None:
    """The vLLM version an ``ai-dynamo`` METADATA pins under its ``vllm`` extra (``vllm[flashinfer,otel,runai]==0.31.0``)."""
    return extra_pin(metadata, ENGINE)


def shipped_vllm(dynamo: str, *, log: Callable[[str], None] = lambda _m: None) -> str | None:
    """The vLLM release ``ai-dynamo[vllm]==dynamo`` pins, read from that release's wheel metadata."""
    return shipped_vllm_from_metadata(dynamo_metadata(dynamo, log=log))


def probe(version: str, *, run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run) -> str:
    """Install official ``vllm==version`` (once), import its prefix-cache code there and build a cache as the
    oracle does; its interpreter.

    Raises :class:`MatrixError` naming the release where it does not install, does not import on CPU, has
    another ``KVCacheManager`` API than the oracle drives, or reports another version than asked."""
    try:
        python = ensure(OFFICIAL_DIST, version)
    except ReleaseEnvError as exc:
        raise MatrixError(f"vllm {version} cannot be installed: {one_line(str(exc))}") from None
    env = {**child_env(), "PYTHONHASHSEED": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
    try:
        res = run([python, "-c", PROBE], capture_output=True, text=True, env=env, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise MatrixError(f"vllm {version}: importing its prefix-cache code took over {PROBE_TIMEOUT_S}s") from None
    if res.returncode != 0:
        raise MatrixError(f"vllm {version}: kvalign's vLLM oracle cannot run it on CPU: "
                          f"{one_line(res.stderr or res.stdout or f'exit {res.returncode}')}")
    got = one_line(res.stdout)
    if got != version:
        raise MatrixError(f"vllm {version}: its environment runs vllm {got or '(no version)'}")
    return python


def pair_env(dynamo_dir: Path | None, version: str) -> tuple[str, dict[str, str]]:
    """Where one pair's check runs: the Dynamo release's environment (the running one for the installed
    Dynamo), told which vLLM release its vLLM oracle runs."""
    python = python_for([dynamo_dir]) if dynamo_dir is not None else sys.executable
    env = child_env() if dynamo_dir is not None else dict(os.environ)
    env[RELEASE_ENV] = f"{OFFICIAL_DIST}=={version}"
    env.setdefault("DYN_LOG", "error")
    return python, env


def check_command(python: str, examples: int | None, all_props: bool = False) -> list[str]:
    """The pair's ``check --engine vllm --json`` (``examples``: ``--vllm-examples``; None: check's default;
    ``all_props``: ``--all``, the opt-in properties too)."""
    return [python, "-m", "kvalign", "check", "--engine", ENGINE, "--json", *(["--all"] if all_props else []),
            *(["--vllm-examples", str(examples)] if examples is not None else [])]


def checked(all_props: bool) -> list[str]:
    """The vLLM properties each pair's check runs: the default ones (workers with int block hashes), or every one."""
    return [p.name for p in registry.of_engine(ENGINE)] if all_props else list(registry.default_names(ENGINE))


def run_pair(dynamo: str, version: str, *, examples: int | None, broken: str | None = None, all_props: bool = False,
             log: Callable[[str], None] = lambda _m: None) -> PairResult:
    """One pair's row (``broken``: why its vLLM release cannot run, from :func:`probe`: an error row)."""
    start = time.perf_counter()
    if version in NOT_DRIVEN:
        return PairResult(dynamo, version, NOT_APPLICABLE, not_applicable=[
            {"property": "vllm", "mode": "plain", "variant": "base", "reason": NOT_DRIVEN[version]}])
    if broken is not None:
        return PairResult(dynamo, version, "error", error=broken)
    try:
        python, env = pair_env(ensure_release("dynamo", dynamo, log=log), version)
        res = _run_check(check_command(python, examples, all_props), env, timeout=PAIR_TIMEOUT_S)
    except (MatrixError, ReleaseEnvError, subprocess.TimeoutExpired, OSError) as exc:
        return PairResult(dynamo, version, "error", error=str(exc), seconds=time.perf_counter() - start)
    return check_result(dynamo, version, res, time.perf_counter() - start)


def run_matrix(pairs: Sequence[Pair], *, examples: int | None, jobs: int = 1, all_props: bool = False,
               progress: Callable[[PairResult, int, int], None] | None = None,
               log: Callable[[str], None] = lambda _m: None) -> list[PairResult]:
    """Every pair, ``jobs`` at a time, results in the order given (``all_props``: each check with ``--all``); each
    vLLM release installed and probed first, once, one at a time (the downloads and the first import are the slow
    part)."""
    broken: dict[str, str] = {}
    for version in dict.fromkeys(p.sglang for p in pairs if p.sglang not in NOT_DRIVEN):
        log(f"vllm {version}: installing (once) and importing its prefix-cache code")
        try:
            probe(version)
        except MatrixError as exc:
            broken[version] = str(exc)
    return run_pairs(pairs, lambda p: run_pair(p.dynamo, p.sglang, examples=examples, broken=broken.get(p.sglang),
                                               all_props=all_props, log=log), jobs, progress)


def columns(results: Sequence[PairResult]) -> list[tuple[str, str]]:
    """The table's (row, mode) columns: every row some pair's check printed, in check's order, then any
    row only a finding or an n/a names."""
    cols = list(dict.fromkeys(c for r in results for c in r.rows))
    for r in results:
        for row in [*r.findings, *r.not_applicable, *r.unconfirmed]:
            if (row["property"], row["mode"]) not in cols:
                cols.append((row["property"], row["mode"]))
    return cols


def fill_not_applicable(results: Sequence[PairResult], cols: Sequence[tuple[str, str]]) -> None:
    """Give each pair whose vLLM release the oracle does not drive an ``n/a`` row per column (with its reason),
    so no cell of its reads ``ok``: nothing ran there."""
    for r in results:
        if r.verdict == NOT_APPLICABLE and cols:
            why = r.not_applicable[0]["reason"]
            r.not_applicable = [{"property": p, "mode": m, "variant": "base", "reason": why} for p, m in cols]


def scope_line(all_props: bool) -> str | None:
    """What the verdicts speak for, as the SGLang matrix says it: deployments without the surfaces of the vLLM
    properties that did not run (by default the opt-in bytes hashes: "Verdicts for deployments without vLLM workers
    with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; not run: vllm_bytes (--all runs every property)."); None where
    every one ran (``--all``)."""
    scope = scope_of(checked(all_props), ENGINE)
    return None if scope.complete else f"Verdicts for {scope.aligned_for()}; {scope.not_run_line()}."


def report_json(results: Sequence[PairResult], versions: dict[str, Any], cols: Sequence[tuple[str, str]],
                all_props: bool = False) -> dict[str, Any]:
    """``matrix --engine vllm --json``: the SGLang matrix's document, a row's engine release under ``vllm``;
    ``properties`` the rows check printed (the table's columns), ``scope`` the vLLM properties that ran and those
    that did not, with their surfaces (:class:`~kvalign.verify.engine.scope.Scope`)."""
    names = list(dict.fromkeys(p for p, _ in cols))
    rows = []
    for r in results:
        row = r.as_json()
        rows.append({"dynamo": row.pop("dynamo"), ENGINE: row.pop("sglang"), **row})
    return {"engine": ENGINE, "versions": versions, "properties": names,
            "scope": scope_of(checked(all_props), ENGINE).as_json(), "rows": rows}
