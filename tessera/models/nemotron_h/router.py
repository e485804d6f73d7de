from tessera.models.base import BaseRouter
from tessera.models.nemotron_h.modeling import NemotronHForCausalLM


class NemotronHRouter(BaseRouter):
    """NVIDIA Nemotron-H, Nemotron Nano v2 and Nemotron 3 (nemotron_h): Mamba-2, attention, MLP
    and mixture-of-experts blocks."""
    model_types = ("nemotron_h",)
    model_cls = NemotronHForCausalLM
    is_moe = True  # tests/models/test_nemotron_h.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (Mamba-2's projections, attention, MLP)
