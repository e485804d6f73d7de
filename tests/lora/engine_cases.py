"""What the LoRA engine tests share: prompts, sampling, PEFT references (cached per
adapter), and checks that an engine is idle."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessera import LLM, SamplingParams
from tessera.lora import LoRARequest
from tests.models.parity import hf_generate

NEW_TOKENS = 16
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# float32 on both sides; measured differences are ~1e-6 (see tests/models/parity.py)
FP32_ATOL = 1e-4


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


# lengths: a few tokens, one block and a bit, several blocks (block_size 16)
PROMPTS = [prompt_ids(n, seed=i) for i, n in enumerate((5, 17, 40))]


@dataclass
class Adapter:
    """A PEFT adapter saved to `path`, and the PEFT model (base + adapter) it came from."""

    path: Path
    model: torch.nn.Module
    _refs: dict = field(default_factory=dict)

    def request(self, name: str, int_id: int = 1) -> LoRARequest:
        return LoRARequest(name, int_id, str(self.path))

    def reference(self, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
        """PEFT's greedy tokens (cached)."""
        key = (tuple(prompt), n)
        if key not in self._refs:
            self._refs[key] = hf_generate(self.model, prompt, n)
        return self._refs[key]


def hf_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] log-softmax of one forward over the whole sequence (row i predicts i + 1)."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


def check_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.requests == {}
    assert engine.block_manager.all_free(), "idle engine holds blocks"


def run(llm: LLM, prompts: list[list[int]], loras=None, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]


def base_reference(base, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    return hf_generate(base[1], prompt, n)

def mixed_requests(base, adapters, names: str, picks: list[int | None]):
    """(prompts, LoRA requests, expected tokens) for requests of `adapters` (picked by index,
    None: the base model) named by the letters of `names`, over PROMPTS in turn."""
    requests = [t.request(name, i + 1) for i, (name, t) in enumerate(zip(names, adapters))]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(picks))]
    loras = [None if k is None else requests[k] for k in picks]
    expected = [base_reference(base, p) if k is None else adapters[k].reference(p)
                for p, k in zip(prompts, picks)]
    return prompts, loras, expected
