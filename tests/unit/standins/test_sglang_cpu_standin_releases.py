"""The stand-in on each supported SGLang release other than the environment's (0.5.23, pinned).

The release is installed into ``kvalign matrix``'s per-version cache (skipped with the reason when
the package index cannot be reached) and the checks run with that release first on ``PYTHONPATH``:

* the release's own patches and the common ones find their targets *in that release* and apply (in the
  release's child that the stand-in's test files share, ``standin_child.py``, before anything else there);
* the allocator launches that stand in for 0.5.21's Triton-only paged allocator equal its Triton
  kernels run by Triton's interpreter, on Hypothesis inputs; a mutant (the next free page instead
  of the right one) must be caught by the same comparison. The inputs are derandomized, so the
  fast tier compares against the kernels' outputs recorded by ``scripts/record_references.py``
  (``tests/unit/recorded.py``) while their key matches, and the nightly runs the kernels and
  requires the recording to match them (as for the stand-in kernels).

This file doubles as the child's script (``--allocator``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/unit's recorded references, also when run as a script
import recorded  # noqa: E402
import standin_child  # noqa: E402

from kvalign.standins import sglang_cpu as standin

ROOT = Path(__file__).resolve().parents[3]
OTHER_RELEASES = [v for v in standin.SUPPORTED if v != standin.SGLANG_VERSION]
EXAMPLES = 150


@pytest.fixture(scope="module", params=OTHER_RELEASES)
def release(request: pytest.FixtureRequest) -> tuple[str, Path]:
    from kvalign.verify.report.matrix import MatrixError, ensure_release

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


def _release_patches(version: str) -> str:
    """The child code of :func:`test_patches_find_their_targets_in_the_release` for ``version``."""
    from kvalign.standins.sglang_cpu.hooks import release_patches

    return (
        "import importlib, json\n"
        "from importlib import metadata\n"
        f"mods = {sorted(release_patches(version))!r}\n"
        "for m in mods: importlib.import_module(m)\n"
        "from sglang.srt.mem_cache.allocator import paged\n"
        "from sglang.srt.disaggregation import kv_events\n"
        "print(json.dumps([metadata.version('sglang'), type(paged.alloc_decode_kernel).__name__,\n"
        "                  kv_events.ZmqEventPublisher.__init__.__code__.co_filename.endswith('patches.py')]))\n"
    )


#: first in the release's shared child (:mod:`standin_child`), before HiCache's pool round trips import anything
standin_child.add("release_patches", _release_patches, OTHER_RELEASES, imports_first=True)


@pytest.mark.slow  # the release's shared child (standin_child) imports its patched modules (scheduler, model stack)
def test_patches_find_their_targets_in_the_release(release, standin_children):
    """Importing every patched module runs the patches; each one's ``_require`` checks its target in
    this release first, so a clean section means every target was found (as in a worker: the harness's
    IPC endpoint is set, so the KV-events patch applies too)."""
    version, where = release
    out = standin_children.section(version, where, "release_patches")
    got_version, decode_launch, publisher_patched = json.loads(out.strip().splitlines()[-1])
    assert got_version == version
    extra = {name for _module, name in standin.SUPPORTED[version].patches}
    assert decode_launch == ("Launch" if "paged_allocator_on_cpu" in extra else "JITFunction")
    assert publisher_patched == ("kv_events_local_publish" in extra)


def _run_stand_ins(version: str, where: Path, cases: list[dict]) -> tuple[str | None, str | None]:
    """The stand-in launches (and the decode mutant) on recorded cases, in this process: the first
    case where each differs from the recorded Triton outputs (None: none differs)."""
    import torch

    from kvalign.standins.sglang_cpu.allocator import alloc_decode_cpu, alloc_extend_launch

    naive = recorded.load_function(where / recorded.ALLOCATOR_SOURCES[1], "alloc_extend_naive", {"torch": torch})
    extend_cpu = alloc_extend_launch(naive)
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    stand_in = mutant = None
    for case in cases:
        p, seq, prefix, pages, last_ext, last_dec = case["batch"]
        bs = len(seq)
        up = 1 << (bs - 1).bit_length()
        got = torch.empty(bs, dtype=torch.int64)
        alloc_decode_cpu(t(seq), t(last_dec), t(pages), got, up, p)
        if stand_in is None and got.tolist() != case["decode"]:
            stand_in = f"decode p={p} seq={seq} last={last_dec}: triton {case['decode']} stand-in {got.tolist()}"
        ext = torch.empty(sum(s - x for s, x in zip(seq, prefix)), dtype=torch.int64)
        extend_cpu(t(prefix), t(seq), t(last_ext), t(pages), ext, up, p)
        if stand_in is None and ext.tolist() != case["extend"]:
            stand_in = f"extend p={p} prefix={prefix} seq={seq}: triton {case['extend']} stand-in {ext.tolist()}"
        alloc_decode_cpu(t(seq), t(last_dec), t(pages)[1:], got, up, p)  # the mutant: the next free page
        if mutant is None and got.tolist() != case["decode"]:
            mutant = f"decode p={p} seq={seq}: triton {case['decode']} mutant {got.tolist()}"
    return stand_in, mutant


def _run_real(where: Path, record: Path | None = None) -> dict:
    argv = [__file__, "--allocator"] + (["--record", str(record)] if record else [])
    proc = _child(where, argv, TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["stand_in"] == "equal" and result["cases"] >= EXAMPLES
    assert result["mutant"].startswith("caught"), result
    return result


def test_allocator_launches_equal_the_recorded_triton_outputs(release):
    """Fast tier: the stand-ins against the release's Triton outputs recorded on the derandomized
    inputs, while the recording's key (release, Triton, kernel sources) matches; the mutant must be
    caught on them. A stale key is said (a StaleReference warning) and the real kernels run instead."""
    version, where = release
    doc = recorded.load("allocator", version)
    why = recorded.stale_reason(doc, recorded.allocator_key(version, where), f" for sglang {version}'s allocator")
    if why:
        warnings.warn(recorded.StaleReference(why + "; running the interpreted Triton kernels instead"))
        _run_real(where)
        return
    assert len(doc["cases"]) >= EXAMPLES
    stand_in, mutant = _run_stand_ins(version, where, doc["cases"])
    assert stand_in is None, stand_in
    assert mutant is not None, "the next-free-page mutant matched every recorded Triton output"


# Nightly, as the stand-in kernels' recording check is (test_sglang_cpu_standin_kernels.py's
# test_recorded_outputs_are_the_interpreted_kernels_outputs): interpreting the release's Triton kernels cost
# 14-15 CPU-s per release in every CI run. The suite holds the stand-ins and the mutant to the recorded outputs
# (test_allocator_launches_equal_the_recorded_triton_outputs) while the recording's key (release, Triton, SHA-256
# of the kernel sources) is the installed one, and names a stale key (test_a_stale_or_missing_recording_is_named).
@pytest.mark.slow  # interprets the release's Triton kernels: 15-30 s per release
@pytest.mark.nightly
def test_allocator_launches_equal_the_release_s_triton_kernels_and_the_recording(request, release, tmp_path):
    """The real thing: the interpreted kernels on the same inputs, and a fresh recording from them
    equal to the committed one (else re-run scripts/record_references.py)."""
    if not recorded.is_nightly(request.config.getoption("markexpr") or ""):
        pytest.skip("interpreted Triton allocator kernels: nightly only (KVALIGN_NIGHTLY=1, HYPOTHESIS_PROFILE=nightly "
                    "or -m nightly); CI holds the stand-ins to the recorded outputs")
    version, where = release
    fresh = tmp_path / "fresh.json"
    _run_real(where, fresh)
    now, committed = json.loads(fresh.read_text()), recorded.load("allocator", version)
    assert committed is not None, f"no recording for sglang {version}: run scripts/record_references.py"
    assert now["key"] == committed["key"], "the key changed: run scripts/record_references.py"
    assert now["cases"] == committed["cases"], "the Triton outputs changed under the same key"


def test_a_stale_or_missing_recording_is_named(release):
    version, where = release
    key = recorded.allocator_key(version, where)
    doc = recorded.load("allocator", version)
    assert recorded.stale_reason(doc, key) is None
    why = recorded.stale_reason(doc, {**key, "triton": "0.0"}, " for x")
    assert why == f"recording for x is stale (triton {key['triton']!r} -> '0.0'): run scripts/record_references.py"
    assert "kernel_source_sha256" in recorded.stale_reason(doc, {**key, "kernel_source_sha256": "0" * 64})
    assert recorded.stale_reason(None, key) == "no recording: run scripts/record_references.py"


# --------------------------------------------------------------------------------------------
# Child side: the release's Triton allocator kernels (interpreted) vs the stand-in's launches.


def _allocator_main(record: str | None = None) -> int:
    """Compare (and with ``record``, write every case with the Triton kernels' outputs to that file)."""
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules.setdefault(name, types.ModuleType(name))
    import torch
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from sglang.kernels.ops.memory.allocator import alloc_decode_kernel, alloc_extend_kernel
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive

    from kvalign.standins.sglang_cpu.allocator import alloc_decode_cpu, alloc_extend_launch

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
    recorded: list[dict] = []

    def compare(decode_impl, batch) -> str | None:
        p, seq, prefix, pages, last_ext, last_dec = batch
        t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        bs, free = len(seq), t(pages)
        up = 1 << (bs - 1).bit_length()
        a, b = torch.empty(bs, dtype=torch.int64), torch.empty(bs, dtype=torch.int64)
        alloc_decode_kernel[(bs,)](t(seq), t(last_dec), free, a, up, p)
        decode_impl(t(seq), t(last_dec), free, b, up, p)
        n = sum(s - x for s, x in zip(seq, prefix))
        ea, eb = torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.int64)
        alloc_extend_kernel[(bs,)](t(prefix), t(seq), t(last_ext), free, ea, up, p)
        extend_cpu(t(prefix), t(seq), t(last_ext), free, eb, up, p)
        if record is not None and decode_impl is alloc_decode_cpu:
            recorded.append({"batch": [p, seq, prefix, pages, last_ext, last_dec],
                             "decode": a.tolist(), "extend": ea.tolist()})
        if not torch.equal(a, b):
            return f"decode p={p} seq={seq} last={last_dec}: triton {a.tolist()} stand-in {b.tolist()}"
        if not torch.equal(ea, eb):
            return f"extend p={p} prefix={prefix} seq={seq}: triton {ea.tolist()} stand-in {eb.tolist()}"
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
    if record is not None:
        import importlib.util
        from importlib import metadata

        import recorded as recorded_module
        from recorded import allocator_key

        root = Path(importlib.util.find_spec("sglang").origin).resolve().parents[1]
        key = allocator_key(metadata.version("sglang"), root)
        Path(record).write_text(recorded_module.dumps({"key": key, "examples": EXAMPLES, "cases": recorded}))
    print(json.dumps({"stand_in": verdict, "cases": cases, "mutant": caught}))
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--allocator"]:
    sys.exit(_allocator_main(sys.argv[3] if sys.argv[2:3] == ["--record"] else None))
