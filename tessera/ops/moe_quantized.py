"""Expert stacks under `--quantization int8 / int4`: each expert's matrices in the format
its dense layers take (tessera/ops/linear_int8.py, linear_int4.py), so a mixture of experts,
whose experts hold nearly all of its weights, shrinks with them (Qwen3-30B-A3B's 29B expert
weights: 58 GB in bf16, about 18 GB in int4).

These reference builders run anywhere: each projection of an expert a step uses goes
through the dense reference builder on that expert's slice of the prepared stack. The CPU
kernels (tessera/ops/cpu/moe_experts.py) and the Triton ones (ops/triton/moe_experts.py)
are registered the same way from their own `linear` builders.
"""
from __future__ import annotations

from tessera.ops import linear_int4, linear_int8  # noqa: F401  (their linear builders)
from tessera.ops.moe import register_per_expert

int8_experts_ref = register_per_expert("torch_linear_int8", "torch_int8_experts")
int4_experts_ref = register_per_expert("torch_linear_int4", "torch_int4_experts")
