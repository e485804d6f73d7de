from tessera.ops.linear_attention import conv, delta_rule, mamba2  # noqa: F401  (registers the reference builders)
from tessera.ops.linear_attention.layer import GatedDeltaRule, GatedShortConv, RecurrentLayer, StateShape
from tessera.ops.linear_attention.mamba2 import Mamba2Scan

__all__ = ["GatedDeltaRule", "GatedShortConv", "Mamba2Scan", "RecurrentLayer", "StateShape"]
