from tessera.models.base import BaseRouter
from tessera.models.granite.modeling import GraniteForCausalLM


class GraniteRouter(BaseRouter):
    """IBM Granite 3.x (dense): Llama with embedding, attention, residual and logits multipliers."""
    model_types = ("granite",)
    model_cls = GraniteForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_models.py (arch granite: weights/gguf_granite.py)
    gguf_permute_qk = True  # (llama.cpp converts Granite as Llama)
    supports_lora = True  # tests/lora/test_lora_models.py
