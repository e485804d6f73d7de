from tessera.models.base import BaseRouter
from tessera.models.lfm2.modeling import Lfm2ForCausalLM
from tessera.models.lfm2.moe import Lfm2MoeForCausalLM


class Lfm2Router(BaseRouter):
    """Liquid AI's LFM2 (lfm2): gated short convolutions and attention layers."""
    model_types = ("lfm2",)
    model_cls = Lfm2ForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_lfm2.py (arch lfm2: weights/gguf_lfm2.py)
    # llama.cpp's names -> the checkpoint's, which the model renames as it does a folder's
    gguf_names = {"shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj",
                  "shortconv.out_proj": "conv.out_proj", "attn_norm": "operator_norm", "ffn_norm": "ffn_norm",
                  "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm",
                  "attn_output": "self_attn.out_proj", "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3",
                  "ffn_down": "feed_forward.w2"}
    gguf_global_names = {"token_embd_norm": "model.embedding_norm"}
    supports_lora = True  # tests/lora/test_lora_models.py (the convolution's projections, attention, MLP)


class Lfm2MoeRouter(BaseRouter):
    """LFM2-MoE (lfm2_moe): LFM2's layers with experts past the first dense ones."""
    model_types = ("lfm2_moe",)
    model_cls = Lfm2MoeForCausalLM
    is_moe = True  # tests/models/test_lfm2.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (the convolution's projections, attention; experts refused)
