"""The op registry: a model states what it needs as an OpSpec and gets an implementation.

Builders declare what they match and carry an explicit priority; the highest-priority builder
that fits wins. A failed lookup names every candidate and why it did not fit. Implementations
are stateless functions, so the same one can serve every layer that asks for it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch

OP_KINDS = (
    "embedding", "linear", "lora_rows", "rms_norm", "rotary", "silu_and_mul",
    "kv_write", "paged_attention", "moe_routing", "moe_experts", "gelu_tanh_and_mul",
    "layer_norm", "gelu", "clamped_swiglu", "causal_conv1d", "gated_delta_rule", "gated_rms_norm", "ssm_scan", "relu_squared", "short_conv",
    "delta_rule_gates", "sigmoid_gate_mul", "sum_and_scale", "moe_scored_routing",
    "gelu_tanh_mul", "silu_mul", "head_matmul", "concat_columns",
    # fused, optional (a layer without a builder runs the ops one by one): rotary, then
    # kv_write; a gated MLP's activation, then its down projection; a layer's input
    # RMSNorm, then the linear reading it
    "rotary_kv_write", "gated_linear", "rms_norm_linear",
)
PHASES = (None, "prefill", "decode")


class OpLookupError(LookupError):
    """No registered builder matches a spec; the message lists each candidate's reasons."""


@dataclass(frozen=True)
class OpSpec:
    """What a layer needs. Frozen and hashable, so lookups are cached; unknown fields are a
    TypeError at construction (a dataclass takes only its declared fields)."""

    kind: str
    device: str
    dtype: torch.dtype
    phase: str | None = None
    head_size: int | None = None
    quant: str | None = None
    tp_size: int = 1
    # attention features a builder may not implement (rejected in its `check`)
    sliding_window: bool = False
    softcap: bool = False
    # a learned per-head logit in every softmax's denominator (gpt-oss's attention sinks)
    sinks: bool = False
    # prefill rows that see keys past their own position, up to a per-row limit
    # (AttentionMetadata.key_limits: a span of tokens attending to each other, Gemma 3's images)
    key_limits: bool = False
    # the KV cache's storage type when it is not the model dtype (kv_write, paged_attention)
    kv_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        if self.kind not in OP_KINDS:
            raise ValueError(f"unknown op kind {self.kind!r}; known kinds: {', '.join(OP_KINDS)}")
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {self.phase!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda' (no index), got {self.device!r}")


@dataclass(frozen=True)
class OpBuilder:
    """One implementation of one op kind and the conditions under which it applies."""

    name: str
    kind: str
    priority: int
    impl: Callable
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...] | None = None  # None: any
    phases: tuple[str | None, ...] | None = None  # None: any
    quant: tuple[str | None, ...] = (None,)
    kv_dtypes: tuple[torch.dtype | None, ...] = (None,)  # quantized KV caches it reads or writes
    check: Callable[[OpSpec], list[str]] | None = None  # extra, builder-specific reasons
    key_limits: bool = False  # implements per-row key limits (OpSpec.key_limits)
    sinks: bool = False  # implements attention sinks (OpSpec.sinks)
    # the layout `impl` wants a loaded weight in (e.g. repacked panels), applied once after
    # loading by the layer that owns the weight; None: used as loaded
    prepare: Callable[[torch.Tensor], torch.Tensor] | None = None

    def rejections(self, spec: OpSpec) -> list[str]:
        """Why this builder cannot serve `spec` (empty when it can)."""
        reasons = []
        if spec.device not in self.devices:
            reasons.append(f"device {spec.device} not in {self.devices}")
        if self.dtypes is not None and spec.dtype not in self.dtypes:
            reasons.append(f"dtype {spec.dtype} not supported")
        if self.phases is not None and spec.phase not in self.phases:
            reasons.append(f"phase {spec.phase} not in {self.phases}")
        if spec.quant not in self.quant:
            reasons.append(f"quantization {spec.quant} not supported")
        if spec.kv_dtype not in self.kv_dtypes:
            reasons.append(f"KV cache dtype {spec.kv_dtype} not supported")
        if spec.key_limits and not self.key_limits:
            reasons.append("no per-row key limits (rows attending past their own position)")
        if spec.sinks and not self.sinks:
            reasons.append("no attention sinks")
        if self.check is not None and not reasons:  # a check may build a kernel: only when it could serve
            reasons.extend(self.check(spec))
        return reasons


@dataclass(frozen=True)
class OpChoice:
    """The result of a lookup: the builder used and why each other candidate was passed over."""

    spec: OpSpec
    builder: OpBuilder
    rejected: tuple[tuple[str, tuple[str, ...]], ...] = field(default=())


_BUILDERS: dict[str, list[OpBuilder]] = {kind: [] for kind in OP_KINDS}


def register_op(kind: str, *, name: str, priority: int, **conditions) -> Callable[[Callable], Callable]:
    """Decorator: register `fn` as a builder for `kind`. Duplicate names are an error."""

    def wrap(fn: Callable) -> Callable:
        if kind not in _BUILDERS:
            raise ValueError(f"unknown op kind {kind!r}")
        if any(b.name == name for b in _BUILDERS[kind]):
            raise ValueError(f"op builder {name!r} registered twice for {kind!r}")
        _BUILDERS[kind].append(OpBuilder(name=name, kind=kind, priority=priority, impl=fn, **conditions))
        _BUILDERS[kind].sort(key=lambda b: -b.priority)
        select_op.cache_clear()
        return fn

    return wrap


@lru_cache(maxsize=None)
def select_op(spec: OpSpec) -> OpChoice:
    """The highest-priority builder that fits `spec`; raises OpLookupError naming every reason."""
    rejected: list[tuple[str, tuple[str, ...]]] = []
    for builder in _BUILDERS[spec.kind]:
        reasons = builder.rejections(spec)
        if not reasons:
            return OpChoice(spec=spec, builder=builder, rejected=tuple(rejected))
        rejected.append((builder.name, tuple(reasons)))
    details = "; ".join(f"{name}: {', '.join(r)}" for name, r in rejected) or "no builders registered"
    raise OpLookupError(f"no implementation of {spec.kind!r} for {spec}: {details}")


def builders(kind: str) -> list[OpBuilder]:
    return list(_BUILDERS[kind])


_SELECTIONS: list[OpChoice] = []


def selections() -> list[OpChoice]:
    """Every distinct lookup made so far in this process, in order (for inspection)."""
    return list(_SELECTIONS)


def get_op(spec: OpSpec) -> Callable:
    """The implementation function for `spec`; records the choice for inspection."""
    choice = select_op(spec)
    if choice not in _SELECTIONS:
        _SELECTIONS.append(choice)
    return choice.builder.impl


@dataclass(frozen=True)
class OpTarget:
    """Where a model's ops run. Layers turn it into specs; model code never looks inside."""

    device: str
    dtype: torch.dtype
    tp_size: int = 1
    tp_rank: int = 0   # which slice of each sharded layer this process holds
    quant: str | None = None  # weight quantization of the linear layers (--quantization)
    kv_cache_dtype: torch.dtype | None = None  # the KV cache's storage type (None: dtype)

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")

    def spec(self, kind: str, **fields) -> OpSpec:
        return OpSpec(kind=kind, device=self.device, dtype=self.dtype, tp_size=self.tp_size, **fields)

    def op(self, kind: str, **fields) -> Callable:
        return get_op(self.spec(kind, **fields))

    def optional_op(self, kind: str, **fields) -> Callable | None:
        """A fused op's implementation where some builder fits, else None: the layer asking
        then runs the ops it fuses one by one."""
        try:
            return self.op(kind, **fields)
        except OpLookupError:
            return None

    def prepare(self, kind: str, **fields) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The chosen builder's weight preparation (see OpBuilder.prepare), or None."""
        return select_op(self.spec(kind, **fields)).builder.prepare
