from tessera.models.base import BaseRouter
from tessera.models.deepseek.modeling import DeepseekForCausalLM

# llama.cpp's names for DeepSeek-style experts (router, correction bias, shared, stacked routed)
EXPERT_GGUF_NAMES = {
    "ffn_gate_inp": "mlp.gate", "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    **{f"ffn_{proj}_shexp": f"mlp.shared_experts.{proj}_proj" for proj in ("gate", "up", "down")},
    **{f"ffn_{proj}_exps": f"mlp.experts.{{e}}.{proj}_proj" for proj in ("gate", "up", "down")},
    "ffn_gate_up_exps": "mlp.experts.gate_up_proj"}  # (--fuse-gate-up-exps: gate rows, then up)


class DeepseekRouter(BaseRouter):
    """DeepSeek-V2 / V2-Lite / V2.5 (deepseek_v2), DeepSeek-V3 / R1 (deepseek_v3) and
    GLM-4.7-Flash (glm4_moe_lite): multi-head latent attention over a latent cache, shared and
    routed experts."""
    model_types = ("deepseek_v2", "deepseek_v3", "glm4_moe_lite")
    model_cls = DeepseekForCausalLM
    is_moe = True  # tests/models/test_deepseek.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_deepseek2.py (arch deepseek2: weights/gguf_deepseek2.py)
    gguf_names = {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                  "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                  "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
                  "attn_k_b": "self_attn.k_b_proj", "attn_v_b": "self_attn.v_b_proj", **EXPERT_GGUF_NAMES}
    supports_lora = True  # tests/lora/test_lora_models.py (the projections around the latent; not kv_b_proj)
