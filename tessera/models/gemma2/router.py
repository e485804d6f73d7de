from tessera.models.base import BaseRouter
from tessera.models.gemma2.modeling import Gemma2ForCausalLM


class Gemma2Router(BaseRouter):
    model_types = ("gemma2",)
    model_cls = Gemma2ForCausalLM
    supports_sliding_window = True  # tests/models/test_gemma2_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py
