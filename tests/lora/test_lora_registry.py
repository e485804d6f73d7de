"""Adapters added and removed by name (requests already holding one finish with it), and
what cannot be served refused with the reason and nothing queued: LoRA not enabled, ranks
over the maximum, another base model, missing or unsafe files, DoRA, modules_to_save,
embedding and LM-head targets, biases, other PEFT types, NaN factors, bad arguments."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tessera.engine.engine import RequestError
from tessera.lora import LoRARequest
from tessera.lora.adapter import LoRAAdapterError, load_adapter
from tests.lora.engine_cases import GREEDY, PROMPTS, run

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest

# --- adding and removing adapters by name ---------------------------------------------------

def test_adapters_are_added_and_removed_by_name(base, trio, make_llm):
    a, b, _ = trio
    llm = make_llm(max_loras=2, lora_modules={"a": str(a.path)})
    engine = llm.engine
    assert [x.name for x in engine.list_loras()] == ["a"]
    prompt = PROMPTS[1]

    def by_name(request_id: str, name: str | None) -> list[int]:
        engine.add_request(request_id, prompt, GREEDY, lora_request=name)
        finished = [o for o in engine.iter_outputs([request_id], stream=False) if o.finished]
        return finished[0].outputs[0].token_ids

    assert by_name("r0", "a") == a.reference(prompt)
    # a name given to LLM.generate names the adapter of every prompt
    assert run(llm, PROMPTS, "a") == [a.reference(p) for p in PROMPTS]
    with pytest.raises(LoRAAdapterError, match="already loaded"):
        engine.add_lora(b.request("a"))
    with pytest.raises(RequestError, match="already loaded"):
        llm.generate([prompt], GREEDY, lora_request=b.request("a"))
    assert engine.remove_lora("a") is True
    assert engine.remove_lora("a") is False
    assert engine.list_loras() == []
    with pytest.raises(RequestError, match="unknown LoRA adapter 'a'"):
        engine.add_request("r1", prompt, GREEDY, lora_request="a")
    assert not engine.has_unfinished() and "r1" not in engine.requests
    assert run(llm, [prompt], a.request("a", 5)) == [a.reference(prompt)]  # added again
    assert by_name("r2", "a") == a.reference(prompt)
    # the same name from the same folder is the same adapter (a no-op), however the folder
    # is spelled
    same = [str(a.path), os.path.relpath(a.path), f"{a.path}/../{a.path.name}", f"{a.path}/"]
    assert all(engine.add_lora(LoRARequest("a", 5, p)) is engine.loras.get("a") for p in same)
    assert [x.name for x in engine.list_loras()] == ["a"]


def test_removing_an_adapter_lets_its_running_requests_finish(trio, make_llm):
    a, b, _ = trio
    llm = make_llm(max_loras=2)
    engine = llm.engine
    engine.add_lora(a.request("a"))
    engine.add_request("r", PROMPTS[2], GREEDY, lora_request="a")
    engine.add_request("w", PROMPTS[0], GREEDY, lora_request=b.request("b", 2))
    for _ in range(3):
        engine.step()
    assert "a" in engine.stats().lora_running
    assert engine.remove_lora("a")
    finished = {o.request_id: o for o in engine.iter_outputs(["r", "w"], stream=False) if o.finished}
    assert finished["r"].outputs[0].token_ids == a.reference(PROMPTS[2])
    assert finished["w"].outputs[0].token_ids == b.reference(PROMPTS[0])
    assert engine.stats().lora_running == ()


# --- what is refused -------------------------------------------------------------------------

def test_lora_requests_need_enable_lora(trio, make_llm):
    llm = make_llm(enable_lora=False)
    with pytest.raises(RequestError, match="enable-lora"):
        llm.generate(PROMPTS, GREEDY, lora_request=trio[0].request("a"))
    with pytest.raises(RequestError, match="enable-lora"):
        llm.engine.add_lora(trio[0].request("a"))
    assert not llm.engine.has_unfinished()
    assert run(llm, PROMPTS[:1]) == run(llm, PROMPTS[:1], [None])  # None is the base model


def _no_weights(folder: Path, tmp: Path) -> Path:
    out = tmp / "no-weights"
    out.mkdir()
    shutil.copy(folder / "adapter_config.json", out)
    return out


def _bin_weights(folder: Path, tmp: Path) -> Path:
    out = _no_weights(folder, tmp)
    (out / "adapter_model.bin").write_bytes(b"")
    return out


def _poisoned(folder: Path, tmp: Path) -> Path:
    """A copy whose first lora_B holds a NaN (it would turn every row of a batch into NaN
    on paths that run rows through all slots)."""
    from safetensors.torch import load_file, save_file

    out = tmp / "poisoned"
    shutil.copytree(folder, out)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    key = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def _edit_config(folder: Path, tmp: Path, **changes) -> Path:
    out = tmp / "edited"
    shutil.copytree(folder, out)
    config = json.loads((out / "adapter_config.json").read_text())
    config.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


# name -> (how to make the folder from (make_adapter, make_tiny_llama, tmp_path), message)
REFUSED = {
    "rank_over_max": (lambda make, tiny, tmp: make(r=32, lora_alpha=32).path, "max_lora_rank 16"),
    "another_base": (lambda make, tiny, tmp: make(hf=tiny(seed=5, hidden_size=32)[1]).path,
                     "trained for another base model"),
    "missing_folder": (lambda make, tiny, tmp: tmp / "nowhere", "is not a directory"),
    "no_safetensors": (lambda make, tiny, tmp: _no_weights(make().path, tmp), "no adapter_model.safetensors"),
    "bin_only": (lambda make, tiny, tmp: _bin_weights(make().path, tmp), "convert it to safetensors"),
    "no_config": (lambda make, tiny, tmp: tmp, "no adapter_config.json"),
    "dora": (lambda make, tiny, tmp: make(use_dora=True).path, "use_dora=True is not supported"),
    "modules_to_save": (lambda make, tiny, tmp: make(modules_to_save=["lm_head"]).path,
                        "modules_to_save=.* is not supported"),
    "embed_tokens": (lambda make, tiny, tmp: make(target_modules=["embed_tokens"]).path,
                     "embedding adapters"),
    "embed_tokens_only_lora": (lambda make, tiny, tmp: make(target_modules=["embed_tokens"],
                                                           save_kwargs=dict(save_embedding_layers=False)).path,
                               "lora_embedding_A.* is not a lora_A/lora_B weight"),
    "lm_head": (lambda make, tiny, tmp: make(target_modules=["q_proj", "lm_head"],
                                            save_kwargs=dict(save_embedding_layers=False)).path,
                "lm_head is a LMHead; adapters can target the attention and MLP projections only"),
    "bias": (lambda make, tiny, tmp: make(bias="lora_only").path, "bias='lora_only' is not supported"),
    "not_lora": (lambda make, tiny, tmp: _edit_config(make().path, tmp, peft_type="IA3"), "is not LoRA"),
    "not_finite": (lambda make, tiny, tmp: _poisoned(make().path, tmp), "NaN or infinite values"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unservable_adapters_are_refused_with_the_reason(case, make_adapter, make_tiny_llama, make_llm,
                                                         tmp_path):
    build, message = REFUSED[case]
    folder = build(make_adapter, make_tiny_llama, tmp_path)
    llm = make_llm(max_loras=2, max_lora_rank=16)
    with pytest.raises(LoRAAdapterError, match=message):
        load_adapter(case, folder, llm.engine.model, max_rank=16)
    # through the offline API: a RequestError (a ValueError), and none of the prompts queued
    good = make_adapter().request("good")
    with pytest.raises(RequestError, match=message) as info:
        llm.generate(PROMPTS[:2], GREEDY, lora_request=[good, LoRARequest(case, 2, str(folder))])
    assert isinstance(info.value, ValueError)
    assert not llm.engine.has_unfinished() and llm.engine.requests == {}
    assert llm.engine.loras.get(case) is None
    assert llm.engine.stats().lora_waiting == ()


def test_request_argument_errors(trio, make_llm):
    llm = make_llm()
    with pytest.raises(ValueError, match="2 LoRA requests for 3 prompts"):
        llm.generate(PROMPTS, GREEDY, lora_request=[None, trio[0].request("a")])
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, str(trio[0].path))
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, str(trio[0].path))
    assert not llm.engine.has_unfinished()
