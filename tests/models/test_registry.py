"""The model registry: model_type -> router, and a clear error for a type nobody serves."""
from __future__ import annotations

import json
import re

import pytest

from tessera import LLM
from tessera.models.base import BaseRouter
from tessera.models.llama.router import LlamaRouter
from tessera.models.registry import UnsupportedModelError, router_classes, supported_model_types


def test_llama_is_registered():
    assert "llama" in supported_model_types()
    assert supported_model_types() == sorted(supported_model_types())
    assert router_classes()["llama"] is LlamaRouter
    for model_type, cls in router_classes().items():
        assert issubclass(cls, BaseRouter) and model_type in cls.model_types


@pytest.mark.parametrize("config", [{"model_type": "nonexistent"}, {}],
                         ids=["unknown-type", "no-type"])
def test_unknown_model_type_lists_the_supported_ones(config, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError) as info:
        LLM(tmp_path, dtype="float32", num_kv_blocks=4, show_progress=False, cache_dir=tmp_path / "cache")
    message = str(info.value)
    assert repr(config.get("model_type")) in message  # names what it found ...
    assert re.search(r"\bllama\b", message)            # ... and what it would have taken
    for model_type in supported_model_types():
        assert model_type in message
    assert isinstance(info.value, ValueError)
