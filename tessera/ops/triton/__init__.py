"""Triton kernels for CUDA, registered as op builders. Triton is imported only when a CUDA
lookup asks for one of them, so CPU installs never need it; the kernels are tested on CPU
through Triton's interpreter (TRITON_INTERPRET=1, tests/ops/test_triton_kernels.py)."""
