from tessera.models.base import BaseRouter
from tessera.models.olmo2.modeling import Olmo2ForCausalLM


class Olmo3Router(BaseRouter):
    """OLMo 3 (7B, 32B): OLMo 2's post-norm layers with sliding-window layers."""
    model_types = ("olmo3",)
    model_cls = Olmo2ForCausalLM
    supports_sliding_window = True  # tests/models/test_family_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py


class Olmo2Router(Olmo3Router):
    """OLMo 2 (1B-32B): post-norm layers; also from llama.cpp's files (OLMo 3's are not read)."""
    model_types = ("olmo2",)
    supports_sliding_window = True  # tests/models/test_family_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_models.py (arch olmo2: weights/gguf_olmo2.py)
    gguf_names = {"post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
    supports_lora = True  # tests/lora/test_lora_models.py
