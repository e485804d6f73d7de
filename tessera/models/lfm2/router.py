from tessera.models.base import BaseRouter
from tessera.models.lfm2.modeling import Lfm2ForCausalLM
from tessera.models.lfm2.moe import Lfm2MoeForCausalLM


# llama.cpp's names -> the checkpoint's, which the model renames as it does a folder's
LFM2_GGUF_NAMES = {
    "shortconv.conv": "conv.conv", "shortconv.in_proj": "conv.in_proj", "shortconv.out_proj": "conv.out_proj",
    "attn_norm": "operator_norm", "ffn_norm": "ffn_norm", "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm", "attn_output": "self_attn.out_proj", "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3", "ffn_down": "feed_forward.w2",
    # LFM2-MoE's router, its choice bias and experts (w1 gate, w3 up, w2 down)
    "ffn_gate_inp": "feed_forward.gate", "exp_probs_b.bias": "feed_forward.expert_bias",
    **{f"ffn_{proj}_exps": f"feed_forward.experts.{{e}}.{w}" for proj, w in (("gate", "w1"), ("up", "w3"),
                                                                             ("down", "w2"))},
    "ffn_gate_up_exps": "feed_forward.experts.gate_up_proj"}


class Lfm2Router(BaseRouter):
    """Liquid AI's LFM2 (lfm2): gated short convolutions and attention layers."""
    model_types = ("lfm2",)
    model_cls = Lfm2ForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_lfm2.py (arch lfm2: weights/gguf_lfm2.py)
    gguf_names = LFM2_GGUF_NAMES
    gguf_global_names = {"token_embd_norm": "model.embedding_norm"}
    supports_lora = True  # tests/lora/test_lora_models.py (the convolution's projections, attention, MLP)


class Lfm2MoeRouter(BaseRouter):
    """LFM2-MoE (lfm2_moe): LFM2's layers with experts past the first dense ones."""
    model_types = ("lfm2_moe",)
    model_cls = Lfm2MoeForCausalLM
    is_moe = True  # tests/models/test_lfm2.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_lfm2.py (arch lfm2moe)
    gguf_names = LFM2_GGUF_NAMES
    gguf_global_names = {"token_embd_norm": "model.embedding_norm"}
    supports_lora = True  # tests/lora/test_lora_models.py (the convolution's projections, attention; experts refused)
