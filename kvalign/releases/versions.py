"""The versions behind a verdict: kvalign, Dynamo's runtime, SGLang and torch.

A bug report or a CI log has to say which releases produced a verdict. The versions are read from
the installed distributions' metadata, never by importing them: importing torch or SGLang costs
seconds and hundreds of MiB, and a broken install must still be reportable.
"""

from __future__ import annotations

import importlib.metadata

#: label -> distribution name, in the order ``kvalign --version`` prints them
DISTRIBUTIONS = {"kvalign": "kvalign", "dynamo-runtime": "ai-dynamo-runtime", "sglang": "sglang", "torch": "torch"}


def installed_versions() -> dict[str, str | None]:
    """Distribution name -> installed version (None when it is not installed)."""
    out: dict[str, str | None] = {}
    for dist in DISTRIBUTIONS.values():
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def version_lines() -> list[str]:
    """One ``label version`` line per component, ``not installed`` where it is missing."""
    versions = installed_versions()
    return [f"{label} {versions[dist] or 'not installed'}" for label, dist in DISTRIBUTIONS.items()]
