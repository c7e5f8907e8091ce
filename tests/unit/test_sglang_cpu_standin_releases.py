"""The stand-in on each supported SGLang release other than the environment's (0.5.21).

The release is installed into ``kvalign matrix``'s per-version cache (skipped with the reason when
the package index cannot be reached) and every check runs in a child process with that release
first on ``PYTHONPATH``:

* the release's own patches and the common ones find their targets *in that release* and apply;
* the allocator launches that stand in for 0.5.21's Triton-only paged allocator equal its Triton
  kernels run by Triton's interpreter, on Hypothesis inputs; a mutant (the next free page instead
  of the right one) must be caught by the same comparison.

This file doubles as the child's script (``--allocator``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kvalign import sglang_cpu_standin as standin

ROOT = Path(__file__).resolve().parents[2]
OTHER_RELEASES = [v for v in standin.SUPPORTED if v != standin.SGLANG_VERSION]
EXAMPLES = 150


@pytest.fixture(scope="module", params=OTHER_RELEASES)
def release(request: pytest.FixtureRequest) -> tuple[str, Path]:
    from kvalign.matrix import MatrixError, ensure_release

    version = request.param
    try:
        where = ensure_release("sglang", version)
    except MatrixError as exc:
        pytest.skip(f"sglang {version} cannot be installed into the wheel cache here: {exc}")
    assert where is not None, f"sglang {version} is the environment's; it is not an 'other' release"
    return version, where


def _child(release_dir: Path, argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", standin.ENABLE_ENV, "SGLANG_USE_CPU_ENGINE")}
    path = os.pathsep.join([str(release_dir), str(ROOT)])
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=600,
                          env={**base, "PYTHONPATH": path, **env})


@pytest.mark.slow  # a child that imports the release's patched modules (its scheduler and model stack): 10-20 s
def test_patches_find_their_targets_in_the_release(release, tmp_path):
    """Importing every patched module runs the patches; each one's ``_require`` checks its target in
    this release first, so a clean exit means every target was found (as in a worker: the harness's
    IPC endpoint is set, so the KV-events patch applies too)."""
    version, where = release
    from kvalign.sglang_cpu_standin.hooks import release_patches

    modules = sorted(release_patches(version))
    code = (
        "import importlib, json\n"
        "from importlib import metadata\n"
        f"mods = {modules!r}\n"
        "for m in mods: importlib.import_module(m)\n"
        "from sglang.srt.mem_cache.allocator import paged\n"
        "from sglang.srt.disaggregation import kv_events\n"
        "print(json.dumps([metadata.version('sglang'), type(paged.alloc_decode_kernel).__name__,\n"
        "                  kv_events.ZmqEventPublisher.__init__.__code__.co_filename.endswith('patches.py')]))\n"
    )
    env = standin.worker_env(os.pathsep.join([str(where), str(ROOT)]))
    env[standin.KV_EVENTS_IPC_ENV] = f"ipc://{tmp_path / 'kv.ipc'}"
    proc = _child(where, ["-c", code], **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got_version, decode_launch, publisher_patched = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got_version == version
    extra = {name for _module, name in standin.SUPPORTED[version].patches}
    assert decode_launch == ("Launch" if "paged_allocator_on_cpu" in extra else "JITFunction")
    assert publisher_patched == ("kv_events_local_publish" in extra)


def test_allocator_launches_equal_the_release_s_triton_kernels(release):
    _version, where = release
    proc = _child(where, [__file__, "--allocator"], TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["stand_in"] == "equal" and result["cases"] >= EXAMPLES
    assert result["mutant"].startswith("caught"), result


# --------------------------------------------------------------------------------------------
# Child side: the release's Triton allocator kernels (interpreted) vs the stand-in's launches.


def _allocator_main() -> int:
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))
    import torch
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from sglang.kernels.ops.memory.allocator import alloc_decode_kernel, alloc_extend_kernel
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive

    from kvalign.sglang_cpu_standin.allocator import alloc_decode_cpu, alloc_extend_launch

    extend_cpu = alloc_extend_launch(alloc_extend_naive)

    def mutant_decode(seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size):
        alloc_decode_cpu(seq_lens, last_loc, free_pages[1:], out_indices, bs_upper, page_size)

    @st.composite
    def batches(draw: st.DrawFn) -> tuple:
        """A batch as the allocator gets it: page-aligned last locations, enough free pages."""
        p = draw(st.sampled_from([1, 2, 4, 16]))
        bs = draw(st.integers(1, 6))
        seq = [draw(st.integers(1, 5 * p)) for _ in range(bs)]
        prefix = [draw(st.integers(0, s)) for s in seq]
        pages = draw(st.permutations(list(range(1, 4 * bs * 5 + 8))))
        used = draw(st.lists(st.integers(100, 200), min_size=bs, max_size=bs))
        last_ext = [u * p + (x - 1) % p if x > 0 else -1 for u, x in zip(used, prefix)]
        last_dec = [u * p + (s - 2) % p for u, s in zip(used, seq)]
        return p, seq, prefix, pages, last_ext, last_dec

    cases = 0
    failures: list[str] = []

    def compare(decode_impl, batch) -> str | None:
        p, seq, prefix, pages, last_ext, last_dec = batch
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        bs, free = len(seq), t(pages)
        up = 1 << (bs - 1).bit_length()
        a, b = torch.empty(bs, dtype=torch.int64), torch.empty(bs, dtype=torch.int64)
        alloc_decode_kernel[(bs,)](t(seq), t(last_dec), free, a, up, p)
        decode_impl(t(seq), t(last_dec), free, b, up, p)
        if not torch.equal(a, b):
            return f"decode p={p} seq={seq} last={last_dec}: triton {a.tolist()} stand-in {b.tolist()}"
        n = sum(s - x for s, x in zip(seq, prefix))
        a, b = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        alloc_extend_kernel[(bs,)](t(prefix), t(seq), t(last_ext), free, a, up, p)
        extend_cpu(t(prefix), t(seq), t(last_ext), free, b, up, p)
        if not torch.equal(a, b):
            return f"extend p={p} prefix={prefix} seq={seq}: triton {a.tolist()} stand-in {b.tolist()}"
        return None

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(batches())
    def stand_in(batch: tuple) -> None:
        nonlocal cases
        cases += 1
        problem = compare(alloc_decode_cpu, batch)
        if problem:
            failures.append(problem)
            raise AssertionError(problem)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(batches())
    def mutant(batch: tuple) -> None:
        problem = compare(mutant_decode, batch)
        assert problem is None, problem

    try:
        stand_in()
        verdict = "equal"
    except AssertionError:
        verdict = failures[-1]
    try:
        mutant()
        caught = "missed"
    except AssertionError as exc:
        caught = f"caught: {str(exc).splitlines()[0]}"
    print(json.dumps({"stand_in": verdict, "cases": cases, "mutant": caught}))
    return 0


if __name__ == "__main__" and sys.argv[1:] == ["--allocator"]:
    sys.exit(_allocator_main())
