"""The op registry: priority order, explained failures, strict specs. Every test that
registers a builder runs inside `isolated_registry`, which restores the global tables."""
from __future__ import annotations

import pytest
import torch

import tessera.ops  # noqa: F401  (registers the real builders)
from tessera.ops import registry
from tessera.ops.registry import (OP_KINDS, OpLookupError, OpSpec, OpTarget, get_op, register_op,
                                  select_op)


@pytest.fixture
def isolated_registry():
    builders = {kind: list(entries) for kind, entries in registry._BUILDERS.items()}
    selections = list(registry._SELECTIONS)
    select_op.cache_clear()
    try:
        yield
    finally:
        registry._BUILDERS.clear()
        registry._BUILDERS.update(builders)
        registry._SELECTIONS[:] = selections
        select_op.cache_clear()


F64 = torch.float64  # no real lookup asks for float64, so fakes that need it never win one


def fake(tag: str):
    def impl(*args):
        return tag
    return impl


def test_real_builders_are_registered_for_every_kind_the_models_use():
    for kind, phase in [("embedding", None), ("linear", None), ("rms_norm", None),
                        ("rotary", None), ("silu_and_mul", None), ("kv_write", None),
                        ("paged_attention", "prefill"), ("paged_attention", "decode")]:
        choice = select_op(OpSpec(kind, "cpu", torch.float32, phase=phase, head_size=16))
        assert choice.builder.kind == kind
    prefill = select_op(OpSpec("paged_attention", "cpu", torch.float32, phase="prefill"))
    decode = select_op(OpSpec("paged_attention", "cpu", torch.float32, phase="decode"))
    assert prefill.builder.name == "torch_paged_prefill"
    assert decode.builder.name == "torch_paged_decode"
    # The decode lookup passed over the prefill builder, and says why.
    assert ("torch_paged_prefill", ("phase decode not in ('prefill',)",)) in decode.rejected


def test_highest_priority_fitting_builder_wins(isolated_registry):
    register_op("linear", name="test_low", priority=5, dtypes=(F64,))(fake("low"))
    register_op("linear", name="test_high_unfit", priority=50, dtypes=(F64,), quant=("awq",))(fake("x"))
    register_op("linear", name="test_high", priority=20, dtypes=(F64,))(fake("high"))
    spec = OpSpec("linear", "cpu", F64)
    choice = select_op(spec)
    assert choice.builder.name == "test_high"
    assert choice.builder.impl() == "high"
    # Only better-ranked builders that did not fit are reported as rejected.
    assert [name for name, _ in choice.rejected if name.startswith("test_")] == ["test_high_unfit"]
    assert "test_low" not in dict(choice.rejected)
    assert get_op(spec)() == "high"
    # Real lookups are unaffected by the float64-only fakes.
    assert select_op(OpSpec("linear", "cpu", torch.float32)).builder.name == "torch_linear"


def test_registering_a_better_builder_invalidates_cached_lookups(isolated_registry):
    register_op("linear", name="test_first", priority=100, dtypes=(F64,))(fake("first"))
    spec = OpSpec("linear", "cpu", F64)
    assert select_op(spec).builder.name == "test_first"
    register_op("linear", name="test_second", priority=200, dtypes=(F64,))(fake("second"))
    assert select_op(spec).builder.name == "test_second"


def test_failed_lookup_names_every_candidate_and_its_reasons(isolated_registry):
    register_op("rms_norm", name="test_cuda_only", priority=30, devices=("cuda",), dtypes=(F64,))(fake("a"))
    register_op("rms_norm", name="test_wrong_dtype", priority=20, dtypes=(torch.bfloat16,))(fake("b"))
    register_op("rms_norm", name="test_custom_check", priority=10, dtypes=(F64,), quant=("gptq",),
                check=lambda spec: [f"head_size {spec.head_size} is not 128"])(fake("c"))
    spec = OpSpec("rms_norm", "cpu", F64, quant="gptq", head_size=64)
    with pytest.raises(OpLookupError) as info:
        select_op(spec)
    message = str(info.value)
    assert "'rms_norm'" in message
    for name in ("test_cuda_only", "test_wrong_dtype", "test_custom_check", "torch_rms_norm"):
        assert name in message
    assert "device cpu not in ('cuda',)" in message
    assert "dtype torch.float64 not supported" in message
    assert "head_size 64 is not 128" in message
    # Every other candidate also fails on the quantization it cannot serve.
    assert message.count("quantization gptq not supported") == len(registry.builders("rms_norm")) - 1
    # Reasons sit next to the builder they belong to.
    section = message.split("test_wrong_dtype:")[1].split(";")[0]
    assert "dtype" in section and "device" not in section


def test_a_builders_check_runs_only_when_its_declared_conditions_pass(isolated_registry):
    """Checks may compile a kernel (the CPU builders' do): one the declared conditions
    already rule out is not asked, so no unused kernel is built."""
    asked = []
    register_op("rms_norm", name="test_checked", priority=99, dtypes=(torch.bfloat16,),
                check=lambda spec: asked.append(spec.dtype) or [])(fake("a"))
    assert select_op(OpSpec("rms_norm", "cpu", F64)).builder.name != "test_checked"
    assert asked == []
    assert select_op(OpSpec("rms_norm", "cpu", torch.bfloat16)).builder.name == "test_checked"
    assert asked == [torch.bfloat16]


def test_lookup_with_no_builders_says_so(isolated_registry):
    registry._BUILDERS["silu_and_mul"] = []
    with pytest.raises(OpLookupError, match="no builders registered"):
        select_op(OpSpec("silu_and_mul", "cpu", torch.float32))


def test_duplicate_builder_names_and_unknown_kinds_are_rejected(isolated_registry):
    with pytest.raises(ValueError, match="registered twice"):
        register_op("linear", name="torch_linear", priority=1)(fake("dup"))
    with pytest.raises(ValueError, match="unknown op kind"):
        register_op("softmax", name="test_softmax", priority=1)(fake("s"))
    assert all(b.name != "test_softmax" for kind in OP_KINDS for b in registry.builders(kind))


def test_the_isolation_fixture_restored_the_registry():
    names = {b.name for kind in OP_KINDS for b in registry.builders(kind)}
    assert not any(name.startswith("test_") for name in names)
    assert registry.builders("silu_and_mul")


def test_op_spec_rejects_unknown_fields_and_kinds():
    with pytest.raises(TypeError):
        OpSpec("linear", "cpu", torch.float32, flavour="fast")
    with pytest.raises(ValueError, match="unknown op kind 'softmax'"):
        OpSpec("softmax", "cpu", torch.float32)
    with pytest.raises(ValueError, match="phase"):
        OpSpec("paged_attention", "cpu", torch.float32, phase="both")
    with pytest.raises(ValueError, match="device"):
        OpSpec("linear", "cuda:0", torch.float32)
    with pytest.raises(TypeError):
        OpTarget("cpu", torch.float32).spec("linear", flavour="fast")


def test_op_spec_is_hashable_and_equal_by_value():
    a = OpSpec("linear", "cpu", torch.float32, head_size=64)
    b = OpTarget("cpu", torch.float32).spec("linear", head_size=64)
    assert a == b and hash(a) == hash(b)
    assert select_op(a) is select_op(b)  # cached
