"""Why a ``gpu_1`` / ``gpu_2`` test cannot run here, worded without starting a child process.

The GPU tests' own prerequisite check (``check_prereqs``) imports ``dynamo.sglang.main`` in a child
(tens of seconds: the import pulls in SGLang's server stack) to say whether ``dynamo.sglang``
imports. On a machine without the GPUs that answer cannot change the verdict, so ``tests/conftest.py``
skips such a test before it runs, naming the missing GPUs and every other prerequisite that is cheap
to check here (a CUDA build of torch, the model weights). With the GPUs present, nothing is skipped
here and the test's own check runs, child import included.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

#: marker -> GPUs the test needs
GPU_MARKERS = {"gpu_1": 1, "gpu_2": 2}


def gpus_needed(item: pytest.Item) -> int:
    return max((n for name, n in GPU_MARKERS.items() if item.get_closest_marker(name)), default=0)


def skip_reason(needed: int, check_prereqs: Callable | None = None, models: tuple[str, str] | None = None) -> str | None:
    """The skip reason when fewer than ``needed`` GPUs are visible; None when they are (or none are needed)."""
    if needed <= 0:
        return None
    if check_prereqs is None:
        from kvalign.live.engines.gpu import check_prereqs
    if models is None:
        from kvalign.live.engines.sglang_worker import default_models

        models = default_models()
    pre = check_prereqs(needed, *models, import_check=False)
    if len(pre.gpus) >= needed:
        return None
    return f"{pre.skip_reason} (whether dynamo.sglang imports is checked only where the GPUs are)"


#: Set on a runner that has the GPUs (the nightly's self-hosted GPU job): there a skipped GPU test is a
#: failure, so a job whose tests all skipped (a CPU torch, a missing model) cannot pass vacuously.
REQUIRE_ENV = "KVALIGN_REQUIRE_GPU"


def fail_if_required(report: pytest.TestReport, needed: int, env: dict[str, str] | None = None) -> None:
    """Turn a GPU test's skip into a failure naming the skip's reason when ``KVALIGN_REQUIRE_GPU=1``."""
    import os

    env = dict(os.environ) if env is None else env
    if not (needed and report.skipped and env.get(REQUIRE_ENV) == "1"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"{REQUIRE_ENV}=1 (a runner with the GPUs), but this GPU test skipped: {reason}"
