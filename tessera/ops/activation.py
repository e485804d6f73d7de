"""Activations: gated ones over a packed gate-up projection (decoders), plain GELU (BERT-style
encoders)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.ops.module import OpModule
from tessera.ops.registry import OpTarget, register_op


@register_op("silu_and_mul", name="torch_silu_and_mul", priority=0)
def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(OpModule):
    kind = "silu_and_mul"  # what a gated down projection applies itself (RowParallelLinear.gated)

    def __init__(self, target: OpTarget):
        super().__init__()
        self._act = target.op("silu_and_mul")

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act(gate_up)


@register_op("gelu_tanh_and_mul", name="torch_gelu_tanh_and_mul", priority=0)
def gelu_tanh_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up: transformers' gelu_pytorch_tanh gated MLP."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


@register_op("silu_mul", name="torch_silu_mul", priority=0)
def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of two tensors (a Mamba-2 mixer's gate without its norm: Falcon-H1's)."""
    return F.silu(gate) * up


@register_op("gelu_tanh_mul", name="torch_gelu_tanh_mul", priority=0)
def gelu_tanh_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up of two tensors (Gemma 4's per-layer input gate)."""
    return F.gelu(gate, approximate="tanh") * up


class GeluTanhAndMul(OpModule):
    kind = "gelu_tanh_and_mul"

    def __init__(self, target: OpTarget):
        super().__init__()
        self._act = target.op("gelu_tanh_and_mul")

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act(gate_up)


@register_op("clamped_swiglu", name="torch_clamped_swiglu", priority=0)
def clamped_swiglu_ref(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's experts (transformers' GptOssExperts): the gate clamped above at `limit`,
    up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate). gate_up: the gate
    half, then the up half."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


class ClampedSwiGLU(OpModule):
    def __init__(self, alpha: float, limit: float, target: OpTarget):
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self._act = target.op("clamped_swiglu")

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act(gate_up, self.alpha, self.limit)


@register_op("gelu", name="torch_gelu", priority=0)
def gelu_ref(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


# transformers' hidden_act names -> F.gelu's `approximate`
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


class Gelu(OpModule):
    def __init__(self, hidden_act: str, target: OpTarget):
        super().__init__()
        if hidden_act not in GELU_APPROXIMATIONS:
            raise ValueError(f"hidden_act {hidden_act!r} is not a GELU ({', '.join(GELU_APPROXIMATIONS)})")
        self.approximate = GELU_APPROXIMATIONS[hidden_act]
        self._act = target.op("gelu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._act(x, self.approximate)


@register_op("sigmoid_gate_mul", name="torch_sigmoid_gate_mul", priority=0)
def sigmoid_gate_mul_ref(x: torch.Tensor, gate: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, N] * sigmoid(gate) (gate [T, N], or [T, 1]: one scale a row), plus `add`
    [T, N] where given: Qwen3-Next's gated attention output, its shared expert's scale."""
    gated = x * torch.sigmoid(gate)
    return gated if add is None else add + gated


@register_op("sum_and_scale", name="torch_sum_and_scale", priority=0)
def sum_and_scale_ref(x: torch.Tensor, other: torch.Tensor | None = None,
                      scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """(x + other) * scale, `other` optional, a scale of 1 no product: Granite's residual
    multiplier on a sublayer's output (its experts' and shared MLP's sum first). A tensor
    `scale` of x's dtype scales each row ([T, 1]: Llama 4's query temperature) or each column
    ([N]: Falcon-H1's muP vectors)."""
    out = x if other is None else x + other
    return out if isinstance(scale, float | int) and scale == 1.0 else out * scale


@register_op("relu_squared", name="torch_relu_squared", priority=0)
def relu_squared_ref(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (transformers' "relu2": Nemotron-H's and Primer's MLPs)."""
    return torch.square(F.relu(x))


class ReluSquared(OpModule):
    def __init__(self, target: OpTarget):
        super().__init__()
        self._act = target.op("relu_squared")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._act(x)
