from tessera.ops.linear_attention import conv, delta_rule  # noqa: F401  (registers the reference builders)
from tessera.ops.linear_attention.layer import GatedDeltaRule, RecurrentLayer, StateShape

__all__ = ["GatedDeltaRule", "RecurrentLayer", "StateShape"]
