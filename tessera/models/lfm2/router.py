from tessera.models.base import BaseRouter
from tessera.models.lfm2.modeling import Lfm2ForCausalLM
from tessera.models.lfm2.moe import Lfm2MoeForCausalLM


class Lfm2Router(BaseRouter):
    """Liquid AI's LFM2 (lfm2): gated short convolutions and attention layers."""
    model_types = ("lfm2",)
    model_cls = Lfm2ForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (the convolution's projections, attention, MLP)


class Lfm2MoeRouter(BaseRouter):
    """LFM2-MoE (lfm2_moe): LFM2's layers with experts past the first dense ones."""
    model_types = ("lfm2_moe",)
    model_cls = Lfm2MoeForCausalLM
    is_moe = True  # tests/models/test_lfm2.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (the convolution's projections, attention; experts refused)
