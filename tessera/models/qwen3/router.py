from tessera.models.base import BaseRouter
from tessera.models.qwen3.modeling import Qwen3ForCausalLM


class Qwen3Router(BaseRouter):
    model_types = ("qwen3",)
    model_cls = Qwen3ForCausalLM
    gguf_permute_qk = False  # llama.cpp's converter does not permute qwen3's Q/K
    supports_gguf = True  # tests/models/test_qwen_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py
