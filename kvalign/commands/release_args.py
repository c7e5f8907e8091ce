"""Release versions as the commands take them: ``1.6.1``, ``0.5.23.post1``, or a wheel file / source checkout that
stands for its own build (``1.6.1+local.3f9c0a1b``). One place, so ``matrix`` (both engines), ``report`` and ``e2e``
accept and refuse the same spellings."""

from __future__ import annotations

import re

from kvalign.errors import UsageError
from kvalign.releases import local_build
from kvalign.releases.release_env import cache_root

VERSION = rf"^\d+(\.\d+)*(\.post\d+)?({local_build.LABEL})?$"


def versions(text: str | None, flag: str) -> list[str] | None:
    """Release versions; an item that names a wheel file or a source checkout stands for that
    build, as its label (``1.6.1+local.3f9c0a1b``)."""
    if text is None:
        return None
    items = [v.strip() for v in text.split(",") if v.strip()]
    kind = flag.lstrip("-")
    found = [local_build.resolve(kind, v, cache_root() / "local-builds").label if local_build.looks_local(v) else v
             for v in items]
    bad = [v for v in found if not re.match(VERSION, v)]
    if not found or bad:
        raise UsageError(f"{flag} takes comma-separated release versions, wheel files or source checkouts, got {text!r}")
    return list(dict.fromkeys(found))
