from tessera.models.base import BaseRouter
from tessera.models.qwen3_moe.modeling import Qwen3MoeForCausalLM


class Qwen3MoeRouter(BaseRouter):
    model_types = ("qwen3_moe",)
    model_cls = Qwen3MoeForCausalLM
    is_moe = True  # tests/models/test_moe_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (attention; experts refused)
    supports_gguf = True  # tests/weights/test_gguf_models.py
    gguf_names = {"ffn_gate_inp": "mlp.gate", "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
                  **{f"ffn_{proj}_exps": f"mlp.experts.{{e}}.{proj}_proj" for proj in ("gate", "up", "down")}}
