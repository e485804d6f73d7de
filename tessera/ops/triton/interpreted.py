"""The CUDA Triton builders on CPU tensors, run by Triton's interpreter (TRITON_INTERPRET=1):
what a GPU run would execute, kernel for kernel, without a GPU. For tests and tools."""
from __future__ import annotations

from tessera.ops import registry


def expose_triton_builders_on_cpu() -> list[str]:
    """Register each CUDA Triton builder again for the CPU, above every CPU builder, as
    `interpreted_<name>`; returns the builders' names."""
    names = []
    for kind in registry.OP_KINDS:
        for b in registry.builders(kind):
            if b.devices == ("cuda",) and b.name.startswith("triton_"):
                registry.register_op(kind, name=f"interpreted_{b.name}", priority=1000, devices=("cpu",),
                                     dtypes=b.dtypes, phases=b.phases, quant=b.quant, check=b.check,
                                     prepare=b.prepare)(b.impl)
                names.append(b.name)
    return names
