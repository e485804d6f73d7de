from tessera.models.base import BaseRouter
from tessera.models.gpt_oss.modeling import GptOssForCausalLM


class GptOssRouter(BaseRouter):
    """OpenAI's gpt-oss-20b / -120b: attention sinks, alternating sliding windows, MoE."""
    model_types = ("gpt_oss",)
    model_cls = GptOssForCausalLM
    is_moe = True  # tests/models/test_gpt_oss.py
    supports_sliding_window = True  # tests/models/test_gpt_oss.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_gguf = True  # tests/weights/test_gguf_gpt_oss.py (arch gpt-oss; MXFP4 experts stay packed)
    gguf_names = {"post_attention_norm": "post_attention_layernorm", "attn_sinks.weight": "self_attn.sinks",
                  "ffn_gate_inp": "mlp.router",
                  **{f"ffn_{proj}_exps": f"mlp.experts.{{e}}.{proj}_proj" for proj in ("gate", "up", "down")},
                  **{f"ffn_{proj}_exps.bias": f"mlp.experts.{proj}_proj_bias" for proj in ("gate", "up", "down")}}
    supports_lora = True  # tests/lora/test_lora_models.py (attention; experts refused)
