"""Record the fast tier's references from the real packages (``tests/unit/recorded.py`` explains them).

For each SGLang release other than the environment's (installed into ``kvalign matrix``'s wheel
cache), run the release's paged-allocator Triton kernels under Triton's interpreter on the
derandomized inputs of ``tests/unit/standins/test_sglang_cpu_standin_releases.py`` and write the inputs,
the kernels' outputs and the key (release, Triton version, kernel-source hash) to
``tests/unit/references/allocator-<release>.json``.

For each supported SGLang release (the environment's included), run the stand-in kernels' call
sites down their Triton branch (interpreted) on derandomized inputs drawn from
``tests/unit/standins/test_sglang_cpu_standin_kernels.py``'s strategies, and write inputs, outputs and key
(release, Triton version, kernel-source hash, strategies hash) to
``tests/unit/references/kernels-<release>.json.gz``.

And the card table of the installed Dynamo x SGLang pair (algorithm -> the ``enable_eagle`` that
``dynamo.sglang``'s real registration code puts on the card, and whether SGLang keys by bigrams),
keyed by (Dynamo, SGLang, Triton, registration-source hash), to
``tests/unit/references/card-<dynamo>-<sglang>.json``.

    PYTHONPATH=. .venv/bin/python scripts/record_references.py [card] [allocator] [kernels] [RELEASE ...]

Kinds default to all three, releases to every release a kind covers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "unit"


def record_allocator(release: str, out: Path) -> dict:
    """Run the interpreted kernels for ``release`` and write the recording to ``out``; returns the child's verdict."""
    from kvalign.standins import sglang_cpu as standin
    from kvalign.verify.report.matrix import ensure_release

    where = ensure_release("sglang", release)
    if where is None:
        raise SystemExit(f"sglang {release} is the environment's; the allocator references are for the other releases")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", standin.ENABLE_ENV, "SGLANG_USE_CPU_ENGINE")}
    env.update(PYTHONPATH=os.pathsep.join([str(where), str(ROOT)]), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(TESTS / "standins" / "test_sglang_cpu_standin_releases.py"), "--allocator",
                           "--record", str(out)], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"recording sglang {release} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def record_kernels(release: str, out: Path) -> dict:
    """Record the stand-in kernels' Triton references of ``release`` to ``out``; returns the recording."""
    from kvalign.verify.report.matrix import ensure_release

    import test_sglang_cpu_standin_kernels as kernels

    where = ensure_release("sglang", release)
    with tempfile.TemporaryDirectory() as tmp:
        return kernels.record(release, where, out, Path(tmp) / "stderr.log")


KINDS = ("card", "allocator", "kernels")


def main(argv: list[str]) -> int:
    from kvalign.standins import sglang_cpu as standin

    sys.path[:0] = [str(TESTS), str(TESTS / "standins")]
    from recorded import path_for

    from recorded import card_key, card_table

    from kvalign.oracles.registration import load_registration

    kinds = [a for a in argv if a in KINDS] or list(KINDS)
    chosen = [a for a in argv if a not in KINDS]

    if "card" in kinds:
        key = card_key()
        out = path_for("card", f"{key['dynamo']}-{key['sglang']}")
        out.parent.mkdir(parents=True, exist_ok=True)
        table = card_table(load_registration())
        out.write_text(json.dumps({"key": key, "table": table}, indent=1, sort_keys=True) + "\n")
        print(f"{out.relative_to(ROOT)}: {len(table)} algorithms, key {key}")

    if "allocator" in kinds:
        for release in [v for v in chosen or standin.SUPPORTED if v != standin.SGLANG_VERSION]:
            out = path_for("allocator", release)
            out.parent.mkdir(parents=True, exist_ok=True)
            verdict = record_allocator(release, out)
            doc = json.loads(out.read_text())
            print(f"{out.relative_to(ROOT)}: {len(doc['cases'])} cases, key {doc['key']}, stand-in {verdict['stand_in']}")

    if "kernels" in kinds:
        for release in chosen or list(standin.SUPPORTED):
            out = path_for("kernels", release)
            out.parent.mkdir(parents=True, exist_ok=True)
            doc = record_kernels(release, out)
            print(f"{out.relative_to(ROOT)}: {len(doc['cases'])} cases, {out.stat().st_size} bytes, key {doc['key']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
