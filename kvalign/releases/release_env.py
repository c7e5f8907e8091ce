"""Each release in an environment of its own: the installer that fills a release's directory, and
the interpreter that runs a pair of releases.

A Dynamo or SGLang release other than the installed one is installed once into a per-version
directory of kvalign's wheel cache (``kvalign matrix`` decides *what* goes in it). Two things here:

- **The installer.** ``uv`` (a kept, fast installer from PyPI, a kvalign dependency) when it is
  there, pip otherwise; ``KVALIGN_INSTALLER=pip|uv`` forces one (the before/after benchmark,
  ``bench/bench_matrix_install.py``, and a machine where uv misbehaves). Both get the same
  ``--no-deps --target`` request, so they fill a directory with the same files.
- **The interpreter.** A pair's check, a release's relay and its router run in a virtual environment
  made for exactly that combination of directories, not under a ``PYTHONPATH`` overlay: its
  ``site-packages`` holds one ``.pth`` file that lists the release directories first, then this
  kvalign, then the running environment's ``site-packages`` (torch, the CPU stack kvalign's own
  dependencies). ``importlib.metadata`` therefore reports the release's versions, the running
  environment is never modified, and an inherited ``PYTHONPATH`` (which Python puts *before*
  site-packages, so it could shadow a release) is dropped from the children's environment. The
  environments are a few KiB each (directories are referenced, not copied) and built once per
  combination.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from kvalign.releases.namespaces import namespace_portions

INSTALLERS = ("uv", "pip")
#: Bumped when an environment must be built differently: an older one is rebuilt, not trusted.
#: 2: release namespace packages pinned to the release's directories.
ENV_SCHEME = 2
#: The directory that holds this ``kvalign`` package (a checkout's root): listed before the base environment, so a
#: pair's check runs this checkout's kvalign, not one the base environment has installed (an editable install of
#: another checkout would otherwise win: the namespace pin imports kvalign while the ``.pth`` is read).
ROOT = Path(__file__).resolve().parents[2]


class ReleaseEnvError(RuntimeError):
    """A release cannot be installed, or its environment cannot be built."""


def cache_root() -> Path:
    """``$KVALIGN_WHEEL_CACHE``, else ``$XDG_CACHE_HOME/kvalign/wheels`` (default ``~/.cache``)."""
    env = os.environ.get("KVALIGN_WHEEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvalign" / "wheels"


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold ``<path>.lock``: concurrent matrix cells share one cache safely."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def uv_binary() -> str | None:
    """The ``uv`` executable: the one the ``uv`` wheel put beside this interpreter, else one on PATH."""
    beside = Path(sys.executable).parent / "uv"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("uv")


def installer() -> str:
    """``uv`` or ``pip``: ``$KVALIGN_INSTALLER`` when set, else uv where it is installed."""
    chosen = os.environ.get("KVALIGN_INSTALLER", "").strip().lower()
    if chosen and chosen not in INSTALLERS:
        raise ReleaseEnvError(f"KVALIGN_INSTALLER={chosen!r}: expected one of {', '.join(INSTALLERS)}")
    if chosen == "uv" and uv_binary() is None:
        raise ReleaseEnvError("KVALIGN_INSTALLER=uv but no uv executable is installed (pip install uv)")
    return chosen or ("uv" if uv_binary() else "pip")


def install_command(target: Path, requirements: Sequence[str]) -> list[str]:
    """The command that installs ``requirements`` (no dependencies) into the directory ``target``.

    The installer resolves for *this* interpreter (uv's ``--python``), so a wheel's tags and a
    requirement's markers are judged as the running environment would judge them."""
    uv = uv_binary() if installer() == "uv" else None
    if uv:
        return [uv, "pip", "install", "--quiet", "--no-deps", "--python", sys.executable,
                "--target", str(target), *requirements]
    return [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
            "--no-compile", "--upgrade", "--target", str(target), *requirements]


def install(target: Path, requirements: Sequence[str]) -> None:
    """Install ``requirements`` into ``target``; a failure is one ReleaseEnvError line naming them."""
    cmd = install_command(target, requirements)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ReleaseEnvError(f"cannot install {' '.join(requirements)}: {exc}") from None
    if res.returncode != 0:
        lines = [ln for ln in (res.stderr or res.stdout).splitlines() if "is ignored" not in ln and ln.strip()]
        raise ReleaseEnvError(f"cannot install {' '.join(requirements)}: {lines[-1] if lines else cmd[0] + ' failed'}")


def base_site_dirs() -> list[str]:
    """The running environment's site-packages (purelib, and platlib where it differs)."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def pth_text(dirs: Sequence[Path]) -> str:
    """The ``.pth`` of an environment for ``dirs``: releases, this kvalign, then the base environment,
    then the pin of each namespace package a release provides (``dynamo``) to that release's directories.

    The base goes through ``site.addsitedir`` so its own ``.pth`` files (editable installs) apply. The
    pin (:mod:`kvalign.releases.namespaces`) comes last: without it ``dynamo``'s path would join the
    base environment's ``dynamo/``, and a subpackage an old release lacks would import from there."""
    lines = [str(d) for d in dirs] + [str(ROOT)]
    lines += [f"import site; site.addsitedir({d!r})" for d in base_site_dirs()]
    portions = namespace_portions(dirs)
    if portions:
        lines.append(f"import kvalign.releases.namespaces as n; n.pin({portions!r})")
    return "\n".join(lines) + "\n"


def env_dir(dirs: Sequence[Path]) -> Path:
    """Where the environment for ``dirs`` lives: named by a hash of what its ``.pth`` says."""
    digest = hashlib.sha256(f"{ENV_SCHEME}\n{sys.executable}\n{pth_text(dirs)}".encode()).hexdigest()[:12]
    names = "+".join(d.name for d in dirs) or "base"
    return cache_root() / "envs" / f"{names}-{digest}"


def _site_packages(env: Path) -> Path:
    found = sorted(env.glob("lib/python*/site-packages"))
    if not found:
        raise ReleaseEnvError(f"{env} has no lib/python*/site-packages: remove the directory to rebuild it")
    return found[0]


def _make_venv(env: Path) -> None:
    uv = uv_binary() if installer() == "uv" else None
    cmd = ([uv, "venv", "--quiet", "--python", sys.executable, str(env)] if uv
           else [sys.executable, "-m", "venv", "--without-pip", str(env)])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        lines = [ln for ln in (res.stderr or res.stdout).splitlines() if ln.strip()]
        raise ReleaseEnvError(f"cannot create the environment {env}: {lines[-1] if lines else 'venv failed'}")


def python_for(dirs: Sequence[Path]) -> str:
    """The interpreter of the environment that runs these release directories (built once)."""
    env = env_dir(dirs)
    python = env / "bin" / "python"
    done = env / ".complete"
    if done.is_file() and python.exists():
        return str(python)
    with locked(env):
        if done.is_file() and python.exists():
            return str(python)
        if env.exists():
            shutil.rmtree(env)
        _make_venv(env)
        (_site_packages(env) / "kvalign-releases.pth").write_text(pth_text(dirs))
        done.write_text(f"scheme {ENV_SCHEME}\n")
    return str(python)


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) without ``PYTHONPATH``: an inherited entry
    would come before the environment's site-packages and could shadow a release."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONPATH", None)
    return env
