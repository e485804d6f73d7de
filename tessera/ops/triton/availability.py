"""Whether the Triton builders can be chosen (a reason for the registry when not)."""
from __future__ import annotations

import importlib.util

from tessera.ops.registry import OpSpec


def triton_missing(spec: OpSpec) -> list[str]:
    if importlib.util.find_spec("triton") is None:
        return ["triton is not installed (pip install triton)"]
    return []
