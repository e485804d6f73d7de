from tessera.models.base import BaseRouter
from tessera.models.nemotron_h.modeling import NemotronHForCausalLM


class NemotronHRouter(BaseRouter):
    """NVIDIA Nemotron-H and Nemotron Nano v2 (nemotron_h): Mamba-2, attention and MLP blocks."""
    model_types = ("nemotron_h",)
    model_cls = NemotronHForCausalLM
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py (Mamba-2's projections, attention, MLP)
