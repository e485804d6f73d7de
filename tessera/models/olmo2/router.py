from tessera.models.base import BaseRouter
from tessera.models.olmo2.modeling import Olmo2ForCausalLM


class Olmo2Router(BaseRouter):
    """OLMo 2 (1B-32B) and OLMo 3 (7B, 32B; sliding-window layers): post-norm layers."""
    model_types = ("olmo2", "olmo3")
    model_cls = Olmo2ForCausalLM
    supports_sliding_window = True  # tests/models/test_family_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_models.py (OLMo 2's arch olmo2: weights/gguf_olmo2.py)
    gguf_names = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
    supports_lora = True  # tests/lora/test_lora_models.py
