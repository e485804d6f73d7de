from tessera.models.base import BaseRouter
from tessera.models.ministral3.modeling import Ministral3ForCausalLM


class Ministral3Router(BaseRouter):
    """Ministral 3's language model (its image-text checkpoints are `mistral3`, whose text
    type this is)."""
    model_types = ("ministral3",)
    model_cls = Ministral3ForCausalLM
    supports_sliding_window = True  # tests/models/test_family_parity.py
    supports_tensor_parallel = True  # tests/distributed/test_tensor_parallel.py
    supports_lora = True  # tests/lora/test_lora_models.py
