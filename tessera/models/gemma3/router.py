from transformers import PretrainedConfig

from tessera.models.base import BaseRouter
from tessera.models.gemma2.router import Gemma2Router
from tessera.models.gemma3.modeling import Gemma3ForCausalLM


class Gemma3Router(BaseRouter):
    # gemma3: the multimodal checkpoints (4B-27B), served text-only through their text_config
    model_types = ("gemma3_text", "gemma3")
    model_cls = Gemma3ForCausalLM
    supports_sliding_window = True  # tests/models/test_gemma3_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py
    supports_gguf = True  # tests/weights/test_gguf_models.py
    # llama.cpp writes Gemma 3 (every size's text model) as Gemma 2, plus attn_q_norm / attn_k_norm
    gguf_names = Gemma2Router.gguf_names
    gguf_norm_offset = 1.0  # every norm, the head norms too, stored as 1 + w

    def get_config(self) -> PretrainedConfig:
        config = super().get_config()
        text = getattr(config, "text_config", None)
        if text is None:
            return config
        # a multimodal config states these at its top level (the text config keeps defaults):
        # an untied head, and the end-of-turn id among its EOS ids
        text.tie_word_embeddings = config.tie_word_embeddings
        if getattr(config, "eos_token_id", None) is not None:
            text.eos_token_id = config.eos_token_id
        return text
