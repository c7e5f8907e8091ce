"""The harness's side of the publisher-fault control (a negative control, scripts only).

A script's ``request`` step may carry ``"publisher_fault": NAME`` (one of
:data:`kvalign.standins.sglang_cpu.publisher_faults.FAULTS`, with optional ``"fault_params"``):
the fault is armed inside the real SGLang worker that the step pins (every publishing worker when
it pins none) right before the request, and disarmed once the request settled. Harmful faults make
the engine reuse pages its own stream never stored in the prompt's chain, which the fuzz must name
``ENGINE_EVENTS_MISSING``; benign ones reshape the stream and must pass.

The workers load the hook only when the fuzz runs with ``publisher_faults`` (tests and control
scripts set it), each with its own control file under ``<run dir>/publisher-faults/``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from kvalign.standins.sglang_cpu.publisher_faults import FAULTS, HARMFUL

__all__ = ["FAULTS", "HARMFUL", "PublisherFaultControl"]


class PublisherFaultControl:
    """Arms, disarms and reads back the faults of each worker's control file."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._next = time.time_ns() // 1000  # ids rise across drivers of one cluster (a worker applies each once)

    def _path(self, label: str) -> Path:
        return self.directory / f"{label}.json"

    def _write(self, label: str, spec: dict[str, Any]) -> None:
        tmp = self._path(label).with_suffix(".tmp")
        tmp.write_text(json.dumps(spec))
        os.replace(tmp, self._path(label))

    def arm(self, labels: list[str], fault: str, params: dict[str, Any] | None = None) -> int:
        """Arm ``fault`` on each of ``labels``; the id the workers acknowledge it with."""
        if fault not in FAULTS:
            raise ValueError(f"unknown publisher fault {fault!r} (one of {', '.join(FAULTS)})")
        self._next += 1
        for label in labels:
            self._write(label, {"id": self._next, "fault": fault, **(params or {})})
        return self._next

    def disarm(self, labels: list[str]) -> None:
        for label in labels:
            self._write(label, {"id": 0, "fault": None})

    def fired(self, label: str, fault_id: int) -> dict[str, Any] | None:
        """What ``label``'s worker did with fault ``fault_id`` (None: it has not fired)."""
        try:
            done = json.loads((self.directory / f"{label}.json.done").read_text())
        except (OSError, ValueError):
            return None
        return done if isinstance(done, dict) and done.get("id") == fault_id else None
