"""Expert stacks under --quantization on CUDA: each projection of an expert a step uses runs
through the Triton int8 / int4 linear kernels (ops/triton/int8_linear.py, int4_linear.py)
on that expert's slice of the stack, laid out as those kernels lay out a dense weight."""
from __future__ import annotations

from tessera.ops.moe import register_per_expert
from tessera.ops.triton import int4_linear, int8_linear  # noqa: F401  (their linear builders)

int8_experts = register_per_expert("triton_int8_linear", "triton_int8_experts")
int4_experts = register_per_expert("triton_int4_linear", "triton_int4_experts")
