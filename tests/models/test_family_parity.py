"""Tessera's SmolLM3, OLMo 2 / 3, Ministral 3, Granite, GLM-4 and Cohere 2 against
transformers' on tiny random checkpoints (tests/models/families.py): logits at prefill and
decode, greedy tokens alone and batched, chunked prefill over cached context, each within
the float32 tolerance of test_llama_parity.py (FP32_ATOL, tests/models/parity.py). Each
family's own claim (NoPE layers, windows, the query temperature, ...) is checked on the
built model, and where the parity alone could hide it, shown to change transformers' answer."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM
from tessera.models.registry import router_classes

from tests.models.families import CASES, MINISTRAL3_ROPE, make_family
from tests.models.parity import (Case, check_chunked_prefill, check_greedy_alone_and_batched,
                                 check_prefill_and_decode_logits, hf_logits, prompt_ids)

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 23, 47)


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def case(request, tmp_path_factory, tiny_tokenizer_dir) -> Case:
    folder = tmp_path_factory.mktemp(request.param)
    hf = make_family(folder, tiny_tokenizer_dir, request.param, seed=len(request.param))
    llm = LLM(folder, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False)
    return Case(request.param, folder, hf, llm)


def _changes_the_answer(case: Case, **config) -> bool:
    """Whether transformers' logits change with `config` over the case's weights."""
    prompt = prompt_ids(40, seed=9)
    other = type(case.hf)(type(case.hf.config)(**{**case.hf.config.to_dict(), **config}))
    other.load_state_dict(case.hf.state_dict())
    return not torch.allclose(hf_logits(other.eval(), prompt), hf_logits(case.hf, prompt), atol=1e-3)


def _windows(case: Case) -> list[int | None]:
    return [layer.self_attn.attn.sliding_window for layer in case.llm.engine.runner.model.model.layers]


def test_checkpoint_has_what_the_case_claims(case: Case):
    model, config = case.llm.engine.runner.model, case.hf.config
    assert type(model).__name__ == type(case.hf).__name__.replace("Olmo3", "Olmo2")  # (one class serves both)
    layers = model.model.layers
    kinds = getattr(config, "layer_types", None) or []
    family = case.name.split("-")[0]
    if family == "smollm3":
        assert [layer.self_attn.uses_rope for layer in layers] == [bool(x) for x in config.no_rope_layers]
        assert not all(config.no_rope_layers) and _changes_the_answer(case, no_rope_layers=[1] * 4, layer_types=None)
        windowed = config.use_sliding_window
        assert _windows(case) == [8 if windowed and kind == "sliding_attention" else None for kind in kinds]
    elif family in ("olmo2", "olmo3"):
        assert _windows(case) == ([8, 8, 8, None] if family == "olmo3" else [None] * len(layers))
        assert (model.model.type_rotary is not None) == (family == "olmo3")
    elif family == "ministral3":
        assert (model.model.beta, model.model.original) == (0.1, 16)
        assert _changes_the_answer(case, rope_parameters={**MINISTRAL3_ROPE, "llama_4_scaling_beta": 0.0})
    elif family == "glm4":
        assert layers[0].self_attn.rotary.rotary_dim == int(16 * (CASES[case.name][1].get("partial_rotary_factor")
                                                                     or 0.5))
    elif family == "cohere2":
        assert _windows(case) == [8 if kind == "sliding_attention" else None for kind in kinds]
    else:
        assert family == "granite" and _changes_the_answer(case, residual_multiplier=1.0)


def test_prefill_and_decode_logits_match(case: Case, monkeypatch):
    check_prefill_and_decode_logits(case.llm, case.hf, case.name, monkeypatch)


def test_greedy_matches_hf_generate_alone_and_batched(case: Case):
    check_greedy_alone_and_batched(case.llm, case.hf, PROMPT_LENGTHS)


def test_chunked_prefill_matches(case: Case, monkeypatch):
    check_chunked_prefill(case.folder, case.llm, case.hf, case.name, monkeypatch, NUM_KV_BLOCKS, PROMPT_LENGTHS)


def test_routed_by_model_type():
    routers = router_classes()
    assert {t: routers[t].__name__ for t in ("smollm3", "olmo2", "olmo3", "ministral3", "granite", "glm4",
                                             "cohere2")} == {
        "smollm3": "SmolLM3Router", "olmo2": "Olmo2Router", "olmo3": "Olmo3Router", "ministral3": "Ministral3Router",
        "granite": "GraniteRouter", "glm4": "Glm4Router", "cohere2": "Cohere2Router"}
