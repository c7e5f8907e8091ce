"""The ``advertised`` property: Dynamo's card and relay, SGLang's /server_info and its events, one block size.

Every number comes from the installed release's own code (SGLang's resolution pipeline and
``describe_kv_events_publisher``, a real radix cache's events, ``dynamo.sglang``'s registration
function and ``kv_event_block_size``). The negative control hands Dynamo's registration the raw launch
arguments, i.e. a registration that reads the page size before SGLang's overrides (Dynamo #13216).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvalign.model.causes import Cause
from kvalign.oracles.base import OracleUnavailable
from kvalign.verify.engine.properties import Mismatch


@pytest.fixture(scope="module")
def registration():
    from kvalign.oracles.registration import load_block_size_registration

    try:
        return load_block_size_registration()
    except OracleUnavailable as exc:
        pytest.skip(f"dynamo.sglang registration code unavailable: {exc}")


@pytest.fixture(scope="module")
def rows_of():
    from kvalign.verify.props.advertised.body import variants

    try:
        return variants()
    except OracleUnavailable as exc:
        pytest.skip(str(exc))


def test_a_row_for_every_page_size_override_and_dcp(rows_of):
    """The rows come from the installed overrides.py: each backend a page-size pass names, SGLang's
    default page, and DCP (0.5.23 has it); the release's own list, not a hand-kept one."""
    from kvalign.oracles.page_overrides import page_overrides

    overrides = page_overrides()
    named = {b for o in overrides for b in o.backends}
    assert {"flashmla", "trtllm_mla", "cutedsl_mla", "trtllm_mha", "hpc_ops", "fa4", "intel_xpu"} <= named
    assert set(rows_of) == named | {"default", "dcp"}
    assert all(rows_of[v] for v in rows_of), "every row has configurations"
    assert {c.role for c in rows_of["flashmla"]} == {"null", "prefill", "decode"}
    assert {c.dcp_size for c in rows_of["dcp"]} == {2, 4}


def test_page_overrides_reads_passes_that_set_page_size():
    """The parser: a decorated pass returning page_size is listed with the backends it compares; an
    undecorated helper, or a pass that sets something else, is not."""
    from kvalign.oracles.page_overrides import page_overrides

    source = '''
@register_post_process
def _forces(view):
    if view.attention_backend == "flashmla" or view.decode_attention_backend in ("fa4", "not-a-backend"):
        return {"page_size": 64}
    return {}

@register_post_process
def _other(view):
    return {"attention_backend": "triton"}

def _helper(view):
    return {"page_size": 1}
'''
    assert [(o.function, o.backends) for o in page_overrides(source)] == [("_forces", ("flashmla", "fa4"))]


def _one(rows_of, variant: str, **where):
    return next(c for c in rows_of[variant] if all(getattr(c, k) == v for k, v in where.items()))


@pytest.mark.parametrize("variant, where", [
    ("flashmla", dict(page_size=16, role="decode")),
    ("fa4", dict(page_size=None, role="prefill")),
    ("dcp", dict(page_size=16, backend="triton", dcp_size=2, model="mha")),
    ("default", dict(page_size=None, platform="blackwell", model="mha")),
])
def test_dynamo_registers_what_sglang_emits(registration, rows_of, variant, where):
    """One configuration per kind (forced, default, DCP): the four numbers agree on the pinned pair."""
    from kvalign.oracles.page_overrides import platform, sglang_sizes
    from kvalign.verify.props.advertised.body import advertised_property

    config = _one(rows_of, variant, **where)
    sizes = sglang_sizes(config)
    assert sizes is not None, f"SGLang rejects {config.flags()}"
    with platform(config.platform):
        advertised_property(registration.derive, config, sizes)
        card, relay = registration.derive(sizes.server_args, config.role)
    assert card == relay == sizes.advertised == sizes.emitted
    if variant == "flashmla":
        assert (sizes.resolved_page, sizes.emitted) == (64, 64), "FlashMLA forces 64 whatever --page-size says"
    if variant == "dcp":
        assert sizes.emitted == 32, "the tree pages at page_size * dcp_size"


def test_a_registration_before_overrides_is_caught(registration, rows_of):
    """Negative control: the same registration code handed the raw launch arguments registers 16 for a
    worker SGLang runs (and publishes) at 64: REGISTERED_BLOCK_SIZE, naming both numbers."""
    from kvalign.oracles.page_overrides import platform, sglang_sizes
    from kvalign.verify.props.advertised.body import advertised_property

    config = _one(rows_of, "flashmla", page_size=16, role="null")
    sizes = sglang_sizes(config)
    with platform(config.platform), pytest.raises(Mismatch) as found:
        advertised_property(lambda sa, role: registration.derive(sa, role, before_overrides=True), config, sizes)
    assert found.value.cause is Cause.REGISTERED_BLOCK_SIZE
    assert "kv_cache_block_size 16" in found.value.detail and "block_size 64" in found.value.detail
    assert found.value.example == dataclasses.asdict(config)


def test_rows_fail_with_the_control_and_pass_without(registration):
    """The row engine on one row (DCP, the widest): ok with Dynamo's own code, REGISTERED_BLOCK_SIZE with
    the control; the configurations SGLang rejects or Dynamo refuses are counted, not run."""
    from kvalign.verify.props.advertised.body import run_row, variants

    configs = [c for c in variants(16)["dcp"] if c.role == "null" and c.backend in (None, "triton", "flashmla")]
    good = run_row(registration.derive, "dcp", configs)
    bad = run_row(lambda sa, role: registration.derive(sa, role, before_overrides=True), "dcp", configs)
    assert good.ok and good.cases > 0 and "refused by Dynamo" in good.detail
    # the control skips Dynamo's launch checks along with the resolution, so it runs what Dynamo refuses too
    assert not bad.ok and bad.cause_name == "REGISTERED_BLOCK_SIZE" and bad.cases >= good.cases
    assert "--dcp-size" in bad.detail


def test_an_advertisement_off_the_events_is_named():
    """/server_info disagreeing with the events (and Dynamo right) is ADVERTISED_BLOCK_SIZE (logic only)."""
    from kvalign.oracles.page_overrides import SglangSizes, WorkerConfig
    from kvalign.verify.props.advertised.body import advertised_property

    sizes = SglangSizes(server_args=None, resolved_page=64, advertised=16, emitted=64)
    with pytest.raises(Mismatch) as found:
        advertised_property(lambda sa, role: (64, 64), WorkerConfig(page_size=16, backend="flashmla"), sizes)
    assert found.value.cause is Cause.ADVERTISED_BLOCK_SIZE and "/server_info advertises 16" in found.value.detail


def test_an_sglang_before_arg_groups_gives_one_n_a_row_not_a_crash(registration, monkeypatch):
    """SGLang 0.5.18 has no ``arg_groups.choices``: with Dynamo 1.5.1's registration loading, check crashed
    there (a matrix error cell). The row is n/a, saying why."""
    import sys

    from kvalign.verify.props.advertised.body import run_advertised_rows

    monkeypatch.setitem(sys.modules, "sglang.srt.arg_groups.choices", None)  # importing it raises ImportError
    (row,) = run_advertised_rows(("plain",), load=lambda: registration)
    assert (row.prop, row.variant) == ("advertised", "base") and "no arg_groups.choices" in row.skipped


def test_a_stand_in_failure_is_not_checked_never_sglangs_refusal(registration, rows_of):
    """SGLang's default page on the XPU platform kvalign presents fails in SGLang's own hardware probe
    (get_xpu_memory_capacity: this host has no XPU): that is kvalign's platform stand-in failing, so those
    configurations are "not checked (kvalign's platform stand-in: ...)" and never counted as rejected by
    SGLang. The control: a configuration SGLang's rules refuse (CuteDSL MLA as a prefill backend) is still
    its refusal (None)."""
    from kvalign.oracles.page_overrides import StandInFailure, WorkerConfig, resolve
    from kvalign.verify.props.advertised.body import run_row

    xpu = [c for c in rows_of["default"] if c.platform == "xpu"][:2]
    assert xpu, "the default row presents the XPU platform"
    with pytest.raises(StandInFailure, match="kvalign's platform stand-in: xpu presented on a host without"):
        resolve(xpu[0])
    assert resolve(WorkerConfig(backend="cutedsl_mla", backend_flag="prefill_attention_backend", model="mla")) is None
    blackwell = [c for c in rows_of["default"] if c.platform == "blackwell"][:1]
    row = run_row(registration.derive, "default", blackwell + xpu)
    assert row.ok and row.cases == 1 and "0 of 3 configurations rejected by SGLang" in row.detail, row.detail
    assert "2 of 3 configurations not checked (kvalign's platform stand-in: xpu" in row.detail, row.detail
    assert row.not_checked and row.not_checked in row.detail
    only = run_row(registration.derive, "default", xpu)
    assert only.status == "n/a" and "not checked (kvalign's platform stand-in: xpu" in only.skipped, only.skipped
