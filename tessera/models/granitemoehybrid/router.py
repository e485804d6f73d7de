from tessera.models.base import BaseRouter
from tessera.models.granitemoehybrid.modeling import GraniteMoeHybridForCausalLM


class GraniteMoeHybridRouter(BaseRouter):
    """IBM Granite 4.0 (granitemoehybrid: the -H hybrids' Mamba-2 and attention layers, and
    the dense attention-only sizes), experts with a shared MLP."""
    model_types = ("granitemoehybrid",)
    model_cls = GraniteMoeHybridForCausalLM
    is_moe = True  # tests/models/test_granite_hybrid.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (Mamba-2's projections, attention, shared MLP)
