from tessera.models.base import BaseRouter
from tessera.models.falcon_h1.modeling import FalconH1ForCausalLM


class FalconH1Router(BaseRouter):
    """TII's Falcon-H1 (falcon_h1): Mamba-2 and attention side by side in every layer."""
    model_types = ("falcon_h1",)
    model_cls = FalconH1ForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (both mixers' projections, the MLP)
