from tessera.models.base import BaseRouter
from tessera.models.mistral.modeling import MistralForCausalLM


class MistralRouter(BaseRouter):
    model_types = ("mistral",)
    model_cls = MistralForCausalLM
    gguf_permute_qk = True  # llama.cpp converts mistral as llama: Q/K rows permuted
    supports_sliding_window = True  # tests/models/test_mistral_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py
