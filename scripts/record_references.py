"""Record the fast tier's references from the real packages (``tests/unit/recorded.py`` explains them).

For each SGLang release other than the environment's (installed into ``kvalign matrix``'s wheel
cache), run the release's paged-allocator Triton kernels under Triton's interpreter on the
derandomized inputs of ``tests/unit/test_sglang_cpu_standin_releases.py`` and write the inputs,
the kernels' outputs and the key (release, Triton version, kernel-source hash) to
``tests/unit/references/allocator-<release>.json``.

And the card table of the installed Dynamo x SGLang pair (algorithm -> the ``enable_eagle`` that
``dynamo.sglang``'s real registration code puts on the card, and whether SGLang keys by bigrams),
keyed by (Dynamo, SGLang, Triton, registration-source hash), to
``tests/unit/references/card-<dynamo>-<sglang>.json``.

    PYTHONPATH=. .venv/bin/python scripts/record_references.py [card] [RELEASE ...]   (default: all)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests" / "unit"


def record_allocator(release: str, out: Path) -> dict:
    """Run the interpreted kernels for ``release`` and write the recording to ``out``; returns the child's verdict."""
    from kvalign import sglang_cpu_standin as standin
    from kvalign.matrix import ensure_release

    where = ensure_release("sglang", release)
    if where is None:
        raise SystemExit(f"sglang {release} is the environment's; the allocator references are for the other releases")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", standin.ENABLE_ENV, "SGLANG_USE_CPU_ENGINE")}
    env.update(PYTHONPATH=os.pathsep.join([str(where), str(ROOT)]), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(TESTS / "test_sglang_cpu_standin_releases.py"), "--allocator",
                           "--record", str(out)], capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"recording sglang {release} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> int:
    from kvalign import sglang_cpu_standin as standin

    sys.path.insert(0, str(TESTS))
    from recorded import path_for

    from recorded import card_key, card_table

    from kvalign.oracles.registration import load_registration

    if not argv or "card" in argv:
        key = card_key()
        out = path_for("card", f"{key['dynamo']}-{key['sglang']}")
        out.parent.mkdir(parents=True, exist_ok=True)
        table = card_table(load_registration())
        out.write_text(json.dumps({"key": key, "table": table}, indent=1, sort_keys=True) + "\n")
        print(f"{out.relative_to(ROOT)}: {len(table)} algorithms, key {key}")

    releases = [a for a in argv if a != "card"] if argv else [v for v in standin.SUPPORTED if v != standin.SGLANG_VERSION]
    for release in releases:
        out = path_for("allocator", release)
        out.parent.mkdir(parents=True, exist_ok=True)
        verdict = record_allocator(release, out)
        doc = json.loads(out.read_text())
        print(f"{out.relative_to(ROOT)}: {len(doc['cases'])} cases, key {doc['key']}, stand-in {verdict['stand_in']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
