"""A config-only model directory, written once per content into kvalign's cache.

SGLang's argument resolution reads a model's ``config.json`` and nothing else, so the page-size and
data-parallel oracles hand it a directory holding only that file. They used to make a fresh temp directory
per process, which nothing removed: ``check`` ends with ``os._exit`` (no exit handlers), so every run left two
directories in ``/tmp``. A directory named by its content's digest is the same for every process and every
run: written once, reused after, nothing to clean.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any


def models_root() -> Path:
    """``$XDG_CACHE_HOME/kvalign/models`` (default ``~/.cache``), beside the wheel cache and the logs."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvalign" / "models"


def config_model_dir(name: str, config: dict[str, Any]) -> str:
    """The directory ``<digest>/<name>`` holding ``config`` as its ``config.json``.

    ``name`` is the directory's last component, as SGLang sees the model's path. The file is written beside
    itself (named by process and thread) and renamed into place, so processes and threads side by side (xdist
    workers, ``check --jobs``) never read a half-written one. Where the cache cannot be written (a read-only
    home), a temp directory as before."""
    text = json.dumps(config, sort_keys=True)
    path = models_root() / hashlib.sha256(f"{name}\0{text}".encode()).hexdigest()[:16] / name
    target = path / "config.json"
    try:
        if not target.is_file() or target.read_text() != text:
            path.mkdir(parents=True, exist_ok=True)
            part = path / f".config.json.{os.getpid()}.{threading.get_ident()}"
            part.write_text(text)
            os.replace(part, target)
    except OSError:
        path = Path(tempfile.mkdtemp(prefix="kvalign-model-")) / name
        path.mkdir()
        (path / "config.json").write_text(text)
    return str(path)
