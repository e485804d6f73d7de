from tessera.models.base import BaseRouter
from tessera.models.gpt_oss.modeling import GptOssForCausalLM


class GptOssRouter(BaseRouter):
    """OpenAI's gpt-oss-20b / -120b: attention sinks, alternating sliding windows, MoE."""
    model_types = ("gpt_oss",)
    model_cls = GptOssForCausalLM
    is_moe = True  # tests/models/test_gpt_oss.py
    supports_sliding_window = True  # tests/models/test_gpt_oss.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (attention; experts refused)
