from tessera.models.base import BaseRouter
from tessera.models.gemma2.modeling import Gemma2ForCausalLM


class Gemma2Router(BaseRouter):
    model_types = ("gemma2",)
    model_cls = Gemma2ForCausalLM
    supports_sliding_window = True  # tests/models/test_gemma2_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py
    supports_gguf = True  # tests/weights/test_gguf_models.py
    # llama.cpp's names for Gemma 2's four norms (ffn_norm is the *pre*-feedforward one here)
    gguf_names = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                  "post_ffw_norm": "post_feedforward_layernorm"}
    gguf_norm_offset = 1.0  # llama.cpp's converter stores Gemma's norms as 1 + w
