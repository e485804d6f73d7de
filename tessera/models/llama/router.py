from tessera.models.base import BaseRouter
from tessera.models.llama.modeling import LlamaForCausalLM


class LlamaRouter(BaseRouter):
    model_types = ("llama",)
    model_cls = LlamaForCausalLM
    gguf_permute_qk = True
    supports_gguf = True  # tests/weights/test_gguf.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_engine.py
