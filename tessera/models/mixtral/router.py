from tessera.models.base import BaseRouter
from tessera.models.mixtral.modeling import MixtralForCausalLM


class MixtralRouter(BaseRouter):
    model_types = ("mixtral",)
    model_cls = MixtralForCausalLM
    is_moe = True  # tests/models/test_moe_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (attention; experts refused)
    supports_gguf = True  # tests/weights/test_gguf_models.py
    gguf_permute_qk = True  # llama.cpp writes Mixtral as arch "llama"
    # stacked experts (ffn_*_exps; gate and up fused by --fuse-gate-up-exps), or one tensor per
    # expert in older files (ffn_*.E)
    gguf_names = {"ffn_gate_inp": "block_sparse_moe.gate",
                  "ffn_gate_up_exps": "block_sparse_moe.experts.gate_up_proj",
                  **{f"{part}{suffix}": f"block_sparse_moe.experts.{{e}}.{w}"
                     for part, w in (("ffn_gate", "w1"), ("ffn_up", "w3"), ("ffn_down", "w2"))
                     for suffix in ("_exps", ".{e}")}}
