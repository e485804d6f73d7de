"""Fixtures of the LoRA engine tests: a tiny Llama base, PEFT adapters of it (made once per
module and configuration), three different ones, and engines checked idle afterwards."""
from __future__ import annotations

import json

import pytest
import torch

from tessera import LLM
from tests.lora.engine_cases import ATTENTION, MLP, Adapter, check_idle
from tests.lora.peft_adapters import save_peft_adapter


@pytest.fixture(scope="module")
def base(make_tiny_llama):
    """(folder, transformers model) of the base every adapter here is trained on."""
    return make_tiny_llama(seed=3)


@pytest.fixture(scope="module")
def make_adapter(base, tmp_path_factory):
    """make_adapter(seed, std, hf=None, **LoraConfig kwargs) -> Adapter, on a copy of `hf`
    (the base model by default). lora_B starts at zero in PEFT: it is drawn here with
    standard deviation `std`, so the adapter changes the model's outputs."""
    built: dict = {}

    def make(seed: int = 1, std: float = 0.05, hf: torch.nn.Module | None = None,
             save_kwargs: dict | None = None, **config) -> Adapter:
        key = (seed, std, id(hf), json.dumps(save_kwargs, sort_keys=True),
               json.dumps(config, sort_keys=True))
        if key in built:
            return built[key]
        config.setdefault("target_modules", ["q_proj", "v_proj", "down_proj", "gate_proj"])
        folder = tmp_path_factory.mktemp("adapter")
        model = save_peft_adapter(base[1] if hf is None else hf, folder, seed, std, save_kwargs, **config)
        built[key] = Adapter(folder, model)
        return built[key]

    return make


@pytest.fixture(scope="module")
def trio(make_adapter):
    """Three different adapters: A (the recipe's targets), B (every projection), C (attention
    only, another rank)."""
    return (make_adapter(seed=1),
            make_adapter(seed=2, target_modules=ATTENTION + MLP),
            make_adapter(seed=3, r=4, lora_alpha=4, std=0.1, target_modules=ATTENTION))


@pytest.fixture
def make_llm(base):
    built: list[LLM] = []

    def make(**kwargs) -> LLM:
        kwargs.setdefault("num_kv_blocks", 64)
        kwargs.setdefault("enable_lora", True)
        llm = LLM(base[0], dtype="float32", show_progress=False, **kwargs)
        built.append(llm)
        return llm

    yield make
    for llm in built:
        check_idle(llm)
