from tessera.models.base import BaseRouter
from tessera.models.minimax_m2.modeling import MiniMaxM2ForCausalLM


class MiniMaxM2Router(BaseRouter):
    """MiniMax-M2, M2.1 and M2.5: GQA attention with whole-projection query / key norms and
    partial rotary, sigmoid-routed experts in every layer."""
    model_types = ("minimax_m2",)
    model_cls = MiniMaxM2ForCausalLM
    is_moe = True  # tests/models/test_minimax_m2.py
    supports_gguf = True  # tests/weights/test_gguf_models.py (arch minimax-m2; transformers reads its config)
    gguf_names = {"ffn_gate_inp": "mlp.gate", "exp_probs_b.bias": "mlp.e_score_correction_bias",
                  **{f"ffn_{proj}_exps": f"mlp.experts.{{e}}.{proj}_proj" for proj in ("gate", "up", "down")}}
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (attention; experts refused)
