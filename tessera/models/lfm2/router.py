from tessera.models.base import BaseRouter
from tessera.models.lfm2.modeling import Lfm2ForCausalLM


class Lfm2Router(BaseRouter):
    """Liquid AI's LFM2 (lfm2): gated short convolutions and attention layers."""
    model_types = ("lfm2",)
    model_cls = Lfm2ForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (the convolution's projections, attention, MLP)
