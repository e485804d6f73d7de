from tessera.models.base import BaseRouter
from tessera.models.cohere2.modeling import Cohere2ForCausalLM


class Cohere2Router(BaseRouter):
    """Cohere 2 (Command R7B, Command A): parallel blocks, NoPE full-attention layers."""
    model_types = ("cohere2",)
    model_cls = Cohere2ForCausalLM
    supports_sliding_window = True  # tests/models/test_family_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_models.py (arch cohere2: weights/gguf_cohere2.py)
    supports_lora = True  # tests/lora/test_lora_models.py
