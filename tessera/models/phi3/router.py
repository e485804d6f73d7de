from tessera.models.base import BaseRouter
from tessera.models.phi3.modeling import Phi3ForCausalLM


class Phi3Router(BaseRouter):
    model_types = ("phi3",)
    model_cls = Phi3ForCausalLM
    supports_sliding_window = True  # tests/models/test_phi3_parity.py "sliding-window"
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py
    supports_gguf = True  # tests/weights/test_gguf_models.py
    # llama.cpp keeps the fused projections whole: attn_qkv, and gate_up_proj as ffn_up
    gguf_names = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
