from tessera.models.base import BaseRouter
from tessera.models.smollm3.modeling import SmolLM3ForCausalLM


class SmolLM3Router(BaseRouter):
    """SmolLM3 (HuggingFaceTB/SmolLM3-3B): Llama with NoPE layers."""
    model_types = ("smollm3",)
    model_cls = SmolLM3ForCausalLM
    supports_sliding_window = True  # tests/models/test_family_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py
    supports_gguf = True  # tests/weights/test_gguf_models.py (arch smollm3: weights/gguf_smollm3.py)
    gguf_permute_qk = True  # llama.cpp converts it as Llama
