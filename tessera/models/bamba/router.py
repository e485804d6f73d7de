from tessera.models.base import BaseRouter
from tessera.models.bamba.modeling import BambaForCausalLM


class BambaRouter(BaseRouter):
    """Bamba (bamba: IBM's Bamba-9B v1 / v2): Mamba-2 and attention layers, SwiGLU MLPs."""
    model_types = ("bamba",)
    model_cls = BambaForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (Mamba-2's projections, attention, the MLP)
