"""Expert stacks through the CPU's packed GEMM kernels: each expert's matrices laid out as
the dense builders lay out a weight (bf16 panels; int8 or int4 panels under --quantization),
and each projection of an expert a step uses run by that builder on the expert's slice.

A decode step gives each chosen expert a row or a few, where torch's GEMM streams weights
at a third of the memory's rate and the packed kernels at most of it (ops/cpu/linear.py);
a prefill gives each expert many rows, which the same kernels run on AMX tiles where the
CPU has them.
"""
from __future__ import annotations

from tessera.ops.cpu import linear, linear_int4, linear_int8  # noqa: F401  (their linear builders)
from tessera.ops.moe import register_per_expert

packed_experts = register_per_expert("cpu_gemm_bf16", "cpu_packed_experts")
packed_experts_avx2 = register_per_expert("cpu_gemm_bf16_avx2", "cpu_packed_experts_avx2")  # CPUs without AVX512
int8_experts = register_per_expert("cpu_gemm_int8", "cpu_int8_experts")
int4_experts = register_per_expert("cpu_gemm_int4", "cpu_int4_experts")
