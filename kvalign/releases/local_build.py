"""A pull request's own build as a matrix release: a local wheel file or a source checkout.

kvalign gates a Dynamo or SGLang pull request on *its* build, checked against the released other
side: ``kvalign matrix --dynamo ./dist/ai_dynamo-1.6.1-py3-none-any.whl --sglang 0.5.21`` (or
``--dynamo ~/src/dynamo``, a checkout that ``pip wheel`` can build) checks that build exactly as it
would check a release, through the same per-version install. The build's row is labelled with its
version and a hash of its content (``1.6.1+local.3f9c0a1b``): two builds that differ in one file
get two rows, and the same checkout built twice gets the same label (the hash reads the files
inside the wheel, not the zip's timestamps), so ``--list-cells`` and ``--cell`` agree.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name, parse_wheel_filename

from kvalign.errors import UsageError

#: The distributions a local build of each side may be.
DISTS = {"dynamo": ("ai-dynamo", "ai-dynamo-runtime"), "sglang": ("sglang",)}
LOCAL_TAG = "+local."
LABEL = r"\+local\.[0-9a-f]{8}"


@dataclass(frozen=True)
class LocalBuild:
    """One local build: what it is and where its wheel lies."""

    kind: str  # dynamo | sglang
    wheel: Path
    dist: str  # the canonical distribution name the wheel holds
    version: str
    label: str  # version + LOCAL_TAG + 8 hex digits of the content hash

    def metadata(self) -> str:
        """The wheel's METADATA text (its pins: ``ai-dynamo`` pins its runtime and its SGLang)."""
        with zipfile.ZipFile(self.wheel) as zf:
            name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            return zf.read(name).decode("utf-8", errors="replace")


_BUILDS: dict[tuple[str, str], LocalBuild] = {}  # (kind, label) -> build
_RESOLVED: dict[tuple[str, str], LocalBuild] = {}  # (kind, text given) -> build: a checkout is built once


def looks_local(text: str) -> bool:
    """A ``--dynamo`` / ``--sglang`` item that names a path rather than a release version."""
    return text.endswith(".whl") or "/" in text or text in (".", "..") or text.startswith("~")


def find(kind: str, label: str) -> LocalBuild | None:
    """The local build registered under ``label`` in this process (None: ``label`` is a release)."""
    return _BUILDS.get((kind, label))


def resolve(kind: str, text: str, build_dir: Path) -> LocalBuild:
    """Register the wheel (or the checkout, built into ``build_dir``) that ``text`` names; its label
    then stands for it wherever a release version would."""
    if (kind, text) in _RESOLVED:
        return _RESOLVED[(kind, text)]
    path = Path(text).expanduser()
    if not path.exists():
        raise UsageError(f"--{kind} {text}: no such wheel file or source checkout")
    wheel = path if path.is_file() else _build(path, build_dir)
    try:
        name, version, _build_tag, _tags = parse_wheel_filename(wheel.name)
        content = _content_hash(wheel)
    except (ValueError, zipfile.BadZipFile, OSError) as exc:
        raise UsageError(f"--{kind} {text}: not a wheel ({exc})") from None
    dist = canonicalize_name(name)
    if dist not in DISTS[kind]:
        raise UsageError(f"--{kind} {text}: a wheel of {dist}, not of {' / '.join(DISTS[kind])}")
    build = LocalBuild(kind, wheel.resolve(), dist, str(version), f"{version}{LOCAL_TAG}{content[:8]}")
    _BUILDS[(kind, build.label)] = _RESOLVED[(kind, text)] = build
    return build


def requirements(build: LocalBuild) -> list[str]:
    """What to install for ``build``: its wheel, and the released half of Dynamo it needs (an
    ``ai-dynamo`` build gets the runtime its METADATA pins; a runtime build gets ``ai-dynamo`` of its
    version); SGLang's wheel alone (its dependencies are completed as for a release)."""
    if build.dist == "ai-dynamo":
        from packaging.requirements import Requirement

        pins = [Requirement(line.split(":", 1)[1].strip()) for line in build.metadata().splitlines()
                if line.startswith("Requires-Dist:")]
        runtime = next((str(sp.version) for r in pins if canonicalize_name(r.name) == "ai-dynamo-runtime"
                        for sp in r.specifier if sp.operator == "=="), build.version)
        return [str(build.wheel), f"ai-dynamo-runtime=={runtime}"]
    if build.dist == "ai-dynamo-runtime":
        return [str(build.wheel), f"ai-dynamo=={build.version}"]
    return [str(build.wheel)]


def _content_hash(wheel: Path) -> str:
    """SHA-256 over the wheel's file names and contents (RECORD left out: it repeats them)."""
    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        for name in sorted(n for n in zf.namelist() if not n.endswith(".dist-info/RECORD")):
            h.update(name.encode() + b"\0" + hashlib.sha256(zf.read(name)).digest())
    return h.hexdigest()


def _build(checkout: Path, build_dir: Path) -> Path:
    """``pip wheel --no-deps`` of a source checkout; the one wheel it writes."""
    build_dir.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="wheel-", dir=build_dir))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
                           "--wheel-dir", str(out), str(checkout)], capture_output=True, text=True, timeout=1800)
    wheels = sorted(out.glob("*.whl"))
    if proc.returncode != 0 or len(wheels) != 1:
        lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        raise UsageError(f"cannot build a wheel from {checkout}: {lines[-1] if lines else 'pip wheel wrote no wheel'}")
    return wheels[0]
