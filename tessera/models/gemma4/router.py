from transformers import PretrainedConfig

from tessera.models.base import BaseRouter
from tessera.models.gemma4.modeling import Gemma4ForCausalLM


class Gemma4TextRouter(BaseRouter):
    model_types = ("gemma4_text",)
    model_cls = Gemma4ForCausalLM
    supports_sliding_window = True  # tests/models/test_gemma4.py
    is_moe = True  # tests/models/test_gemma4.py (the 26B A4B: experts beside the dense MLP)
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py


class Gemma4Router(Gemma4TextRouter):
    """Gemma 4's released checkpoints (E2B, E4B, 26B A4B, 31B): image-text (the small ones
    audio too). Served text in, text out: its language model from text_config; images and
    audio are refused (supports_images is not claimed)."""
    model_types = ("gemma4",)
    is_moe = True  # tests/models/test_gemma4.py
    supports_sliding_window = True  # tests/models/test_gemma4.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py

    def get_config(self) -> PretrainedConfig:
        full = super().get_config()
        text = full.text_config
        # the end-of-turn ids are among the top level's EOS ids
        if getattr(full, "eos_token_id", None) is not None:
            text.eos_token_id = full.eos_token_id
        text.tie_word_embeddings = bool(getattr(full, "tie_word_embeddings", True))
        return text
