from tessera.models.base import BaseRouter
from tessera.models.qwen2.modeling import Qwen2ForCausalLM


class Qwen2Router(BaseRouter):
    model_types = ("qwen2",)
    model_cls = Qwen2ForCausalLM
    gguf_permute_qk = False  # llama.cpp's converter does not permute qwen2's Q/K
    supports_gguf = True  # tests/models/test_qwen_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py
