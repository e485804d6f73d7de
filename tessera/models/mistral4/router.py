from tessera.models.base import BaseRouter
from tessera.models.mistral4.modeling import Mistral4ForCausalLM


class Mistral4Router(BaseRouter):
    """Mistral Small 4 (mistral4): DeepSeek-V3's latent attention and experts, Mistral's
    softmax router, Llama 4's attention temperature."""
    model_types = ("mistral4",)
    model_cls = Mistral4ForCausalLM
    is_moe = True  # tests/models/test_mistral4.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (the projections around the latent, as DeepSeek's)
