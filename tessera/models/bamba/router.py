from tessera.models.base import BaseRouter
from tessera.models.bamba.modeling import BambaForCausalLM


class BambaRouter(BaseRouter):
    """Bamba (bamba: IBM's Bamba-9B v1 / v2): Mamba-2 and attention layers, SwiGLU MLPs."""
    model_types = ("bamba",)
    model_cls = BambaForCausalLM
