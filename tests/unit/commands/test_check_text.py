"""``kvalign check``'s text report fits 100 columns, whatever its rows hold (kvalign/commands/check_text.py).

The rows here are the real ones' worst cases, copied from a run of the pinned pair (the servable
finding: a 145-character cause, a 130-character condition, a long shrunk counterexample), plus a
skipped row with its long reason and a long router-hasher label. The real command's output is held
to the same width in tests/unit/verify/runner/test_check.py and tests/unit/commands/test_readme.py.
"""

from __future__ import annotations

from kvalign.commands import check_text
from kvalign.model.causes import Cause
from kvalign.verify.engine.rows import RowResult

CONDITION = ("only with HiCache on and page sizes below SGLang's load_back_threshold (10 tokens); --page-size 10 or "
             "more does not show it")
EXAMPLE = {"page_size": 2, "eagle": False, "core": "RustUnifiedTreeCore", "policy": "write_through",
           "host_tokens": "unbounded", "steps": [("cache", [0, 0], (None, None), "+transfers_done"),
                                                 ("evict_device", 64), ("admit", [0, 0], (None, None))]}
SKIPPED = ("kvalign's HiCache transfer stand-in (kvalign/standins/hicache.py) is pinned to SGLang 0.5.23; SGLang "
           "0.5.21's host-tier internals are unchecked (SGLang 0.5.21 does publish HiCache events (medium 'CPU_PINNED'))")


def _servable(mode: str) -> RowResult:
    c = Cause.HOST_CREDIT_NOT_SERVABLE
    return RowResult("servable", mode, "base", 106, 18, 2.8, c.value, c.name,
                     "page size 2: the prompt's host-only stretch is 2 tokens, below SGLang's load_back_threshold (10), "
                     "so SGLang loaded 0 back and re-prefills it; the router credits 1 host block(s) for it",
                     EXAMPLE, condition=CONDITION)


ROWS = [RowResult("card", "plain", "base", 6, 0, 0.0), RowResult("ingest", "eagle", "lora+namespace", 25, 0, 1.5),
        RowResult("tier", "plain", "lora", skipped=SKIPPED), RowResult("tier", "eagle", "lora", skipped=SKIPPED),
        _servable("plain"), _servable("eagle")]
LABEL = "my_patched_router.hashing.experimental_variants:compute_block_hash_for_seq_with_bigram_windows_v2"


def _report() -> str:
    return "\n".join([check_text.header(LABEL, "0.5.23", "unified", "1.6.1", 200, None),
                      *map(check_text.progress_line, ROWS),
                      check_text.table(ROWS), check_text.explanations(ROWS), check_text.verdict(ROWS, 170.3)])


def test_the_rows_are_wide_enough_to_need_it():
    """The control: the old table put cause and condition in the result cell, 300+ columns here."""
    old_cell = f"MISALIGNED: {Cause.HOST_CREDIT_NOT_SERVABLE.value} ({CONDITION})"
    assert len(old_cell) + len("servable  plain  base            106    18          ") > 300
    assert len(SKIPPED) > 100 and len(str(EXAMPLE)) > 100


def test_no_line_is_wider_than_100_columns():
    assert [ln for ln in _report().splitlines() if len(ln) > check_text.WIDTH] == []


def test_the_table_names_causes_short_and_each_cause_is_explained_once_under_it():
    table = check_text.table(ROWS).splitlines()
    assert table[-1].split() == ["servable", "eagle", "base", "106", "18", "credit-skew:", "HOST_CREDIT_NOT_SERVABLE"]
    assert [ln.split()[-1] for ln in table[2:6]] == ["ok", "ok", "n/a", "n/a"]
    below = check_text.explanations(ROWS)
    assert below.count("HOST_CREDIT_NOT_SERVABLE (credit-skew): ") == 1 and below.count("n/a (did not run) tier/") == 1
    text = " ".join(ln.strip() for ln in below.splitlines())  # unwrapped: every piece said whole
    assert f"HOST_CREDIT_NOT_SERVABLE (credit-skew): {Cause.HOST_CREDIT_NOT_SERVABLE.value}" in text
    assert "rows: servable/plain/base, servable/eagle/base" in text
    assert f"scope: holds {CONDITION}" in text
    assert "counterexample (servable/plain/base): page size 2: the prompt's host-only stretch" in text
    assert "shrunk: {'page_size': 2," in text and "('admit', [0, 0], (None, None))]}" in text
    assert f"n/a (did not run) tier/plain/lora, tier/eagle/lora: {SKIPPED}" in text


def test_an_unconfined_cause_s_scope_is_its_rows_at_the_page_sizes_checked():
    c = Cause.ROUTER_EAGLE_OFF
    rows = [RowResult("hash", "eagle", "base", 14, 7, 0.2, c.value, c.name, "router gives 1 blocks", {"tokens": [0]})]
    assert "  scope: these rows, at page size 16" in check_text.explanations(rows, 16)
    assert "  scope: these rows, at every page size the strategies draw" in check_text.explanations(rows)


def test_the_verdict_comes_first_then_where_a_cause_holds():
    lines = check_text.verdict(ROWS, 170.3).splitlines()
    assert lines[0] == "ALIGNED: 243 cases in 170.3s, 0 of 4 rows cache-blind, 2 credit-skew (advisory), 2 n/a"
    strict = check_text.verdict(ROWS, 170.3, strict=True).splitlines()[0]
    assert strict.startswith("MISALIGNED: 243 cases")
    assert " ".join(ln.strip() for ln in lines[1:]) == f"HOST_CREDIT_NOT_SERVABLE holds {CONDITION}"
    ok = ROWS[:2]
    assert check_text.verdict(ok, 1.0) == "ALIGNED: 31 cases in 1.0s, 0 of 2 rows cache-blind, 0 credit-skew (advisory)"
    assert check_text.explanations(ok) == ""


def _capped(row: RowResult, cases: int) -> RowResult:
    row.scoped = {Cause.LAST_PAGE_CAPPED.name: {
        "cases": cases, "cause": Cause.LAST_PAGE_CAPPED.value, "condition": "only for a prompt that ends at a page boundary",
        "detail": "page size 4: a 4-token prompt; SGLang's scheduler matches at most 3 tokens of it"}}
    return row


def test_a_cause_counted_apart_leaves_the_cell_and_the_verdict_alone_and_is_said_under_the_table():
    """LAST_PAGE_CAPPED never fails a row: its cell stays ``ok`` (or the row's own cause), the rows it was
    counted in are named under the table with their counts, and the verdict line stays ALIGNED."""
    rows = [_capped(RowResult("tier", "plain", "base", 12, 0, 1.0), 3), _capped(_servable("plain"), 140)]
    rows[1].admission = {"prompt_tokens": 3, "device_tokens": 0, "host_only_tokens": 2, "loaded_tokens": 0}
    table = check_text.table(rows).splitlines()
    assert table[2].split()[-1] == "ok" and table[3].split()[-1] == "HOST_CREDIT_NOT_SERVABLE"
    below = check_text.explanations(rows)
    flat = " ".join(below.split())  # the lines are wrapped to 100 columns
    assert "LAST_PAGE_CAPPED (counted apart, not a mismatch)" in flat
    assert "143 cases: tier/plain/base 3, servable/plain/base 140" in flat
    assert "prompt_tokens 3, device_tokens 0, host_only_tokens 2, loaded_tokens 0" in flat
    assert check_text.verdict(rows[:1], 1.0).splitlines() == [
        "ALIGNED: 12 cases in 1.0s, 0 of 1 rows cache-blind, 0 credit-skew (advisory)", "  LAST_PAGE_CAPPED counted apart in 3 cases (not a misalignment)"]
    assert [ln for ln in below.splitlines() if len(ln) > check_text.WIDTH] == []


def test_a_credit_skew_is_an_advisory_under_the_table_with_its_bound_and_routing_impact():
    rows = [_servable("plain"), RowResult("card", "plain", "base", 6, 0, 0.0)]
    rows[0].impact = "bound: at most 8 host slots per request at page size 2; on the counterexample the router ..."
    text = " ".join(ln.strip() for ln in check_text.advisory_lines(rows).splitlines())
    assert "advisory (credit-skew, exit 0; --strict fails on it): HOST_CREDIT_NOT_SERVABLE in servable/plain/base" in text
    assert "servable/plain/base: bound: at most 8 host slots" in text
    blind = Cause.ROUTER_EAGLE_OFF
    assert check_text.advisory_lines([RowResult("hash", "eagle", "base", 3, 1, 0.0, blind.value, blind.name)]) == ""


def test_what_a_row_that_ran_did_not_check_is_said_under_the_table():
    row = RowResult("advertised", "plain", "default", 72, 0, 1.0, not_checked="36 of 108 configurations not checked "
                    "(kvalign's platform stand-in: xpu presented on a host without that device; ...)")
    text = " ".join(ln.strip() for ln in check_text.explanations([row]).splitlines())
    assert "partly checked advertised/plain/default: 36 of 108 configurations not checked (kvalign's platform" in text


def test_verdict_counts_the_negative_controls_and_names_one_that_did_not_fail():
    caught = {"mutation": "drop_removals", "cases": 5, "failed": True, "cause": "INGEST_STALE", "expected": "INGEST_STALE"}
    missed = {**caught, "failed": False, "cause": None}
    rows = [RowResult("hybrid", "plain", "swa", 10, 0, control=caught),
            RowResult("hybrid", "plain", "mamba", 10, 0, control=missed)]
    lines = check_text.verdict(rows, 1.0).splitlines()
    assert "  negative controls: 1 of 2 failed as they must" in lines
    assert any("control of hybrid/plain/mamba did not fail" in line and "expected INGEST_STALE" in line for line in lines)
    assert check_text.controls(rows[:1]) == ["  negative controls: 1 of 1 failed as they must"]


def test_a_row_that_ran_and_never_exercised_its_subject_is_na_saying_so():
    """A storage row in which no refill was loaded back ran its examples and could not have failed: ``n/a``
    in the table, the verdict and ``--json``, its reason under the table as a row that never exercised what
    it checks (a row that did not run keeps "did not run")."""
    from kvalign.verify.engine.rows import row_json

    why = "ran 8 example(s), none exercising what this row checks: no refill from storage was loaded back"
    rows = [RowResult("storage", "plain", "base", 8, 0, 3.0, skipped=why), RowResult("tier", "plain", "lora", skipped=SKIPPED)]
    assert [ln.split()[-1] for ln in check_text.table(rows).splitlines()[2:]] == ["n/a", "n/a"]
    text = " ".join(ln.strip() for ln in check_text.explanations(rows).splitlines())
    assert f"n/a (never exercised) storage/plain/base: {why}" in text and "n/a (did not run) tier/plain/lora" in text
    assert check_text.verdict(rows, 1.0).startswith("ALIGNED: 8 cases in 1.0s, 0 of 0 rows cache-blind")
    assert row_json(rows[0])["status"] == "n/a" and row_json(rows[0])["shrink_steps"] == 0
