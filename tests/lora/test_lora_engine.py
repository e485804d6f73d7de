"""Multi-LoRA serving end to end: PEFT adapters on a tiny Llama give PEFT's greedy tokens and
logprobs (attention, MLP, all projections, one shard of a packed layer, rsLoRA, alpha and
rank patterns, one layer only); adapters and the base model share batches (chunked prefill,
async scheduling, preemption, more adapters than slots, tensor parallelism, speculative
decoding) without changing any output; the prefix cache never hands KV across adapters;
adapters are added and removed by name; what cannot be served is refused with the reason
and nothing queued. Every engine ends with all KV blocks free."""
from __future__ import annotations

import copy
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model  # a test dependency (pyproject's test extras)

from tessera import LLM, SamplingParams
from tessera.engine.engine import RequestError
from tessera.lora import LoRARequest
from tessera.lora.adapter import LoRAAdapterError, load_adapter
from tests.models.parity import hf_generate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest

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
            self._refs[key] = hf_greedy(self.model, prompt, n)
        return self._refs[key]


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    return hf_generate(model, prompt, n)


def hf_logprobs(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] log-softmax of one forward over the whole sequence (row i predicts i + 1)."""
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)


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
        config.setdefault("r", 8)
        config.setdefault("lora_alpha", 16)
        config.setdefault("target_modules", ["q_proj", "v_proj", "down_proj", "gate_proj"])
        torch.manual_seed(seed)
        model = get_peft_model(copy.deepcopy(base[1] if hf is None else hf),
                               LoraConfig(lora_dropout=0.0, **config))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name or "lora_embedding_B" in name:
                    torch.nn.init.normal_(p, std=std)
        model.eval()
        folder = tmp_path_factory.mktemp("adapter")
        model.save_pretrained(folder, **(save_kwargs or {}))
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


def check_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished()
    assert engine.requests == {}
    assert engine.block_manager.all_free(), "idle engine holds blocks"


def run(llm: LLM, prompts: list[list[int]], loras=None, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]


def base_reference(base, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    return hf_greedy(base[1], prompt, n)


# --- parity with PEFT ----------------------------------------------------------------------

PARITY_CASES = {
    "attention": dict(target_modules=ATTENTION),
    "mlp": dict(target_modules=MLP),
    "all": dict(target_modules=ATTENTION + MLP),
    # one shard of the packed QKV layer: the q and v rows must get nothing
    "k_only": dict(target_modules=["k_proj"], std=0.3),
    "rslora": dict(target_modules=ATTENTION + MLP, use_rslora=True),
    "alpha_pattern": dict(target_modules=["q_proj", "v_proj", "down_proj"], alpha_pattern={"v_proj": 64}),
    # shards of one packed layer with different ranks (q 4, v 8), and a per-layer alpha
    "rank_pattern": dict(target_modules=["q_proj", "v_proj", "up_proj"], rank_pattern={"q_proj": 4},
                         alpha_pattern={"model.layers.1.mlp.up_proj": 2}),
    "one_layer": dict(target_modules=ATTENTION + MLP, layers_to_transform=[1]),
    "max_rank": dict(target_modules=["q_proj", "gate_proj", "o_proj"], r=16, lora_alpha=8),
}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_greedy_tokens_and_logprobs_equal_peft(case, base, make_adapter, make_llm):
    adapter = make_adapter(seed=11, **PARITY_CASES[case])
    llm = make_llm(max_loras=1, max_lora_rank=16)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    outs = llm.generate(PROMPTS, params, lora_request=adapter.request(case))
    changed = False
    for prompt, out in zip(PROMPTS, outs):
        got = out.outputs[0].token_ids
        assert got == adapter.reference(prompt), prompt
        full = prompt + got
        want = hf_logprobs(adapter.model, full)
        # row p - 1 predicts token p: the prompt's (prefill) then the generated ones (decode)
        targets = torch.tensor(full[1:])[:, None]
        want_chosen = want[:-1].gather(1, targets)[:, 0]
        got_prompt = [out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))]
        got_new = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, got)]
        torch.testing.assert_close(torch.tensor(got_prompt + got_new), want_chosen, atol=FP32_ATOL, rtol=0)
        base_lp = hf_logprobs(base[1], full)[:-1].gather(1, targets)[:, 0]
        changed |= bool((base_lp - want_chosen).abs().max() > 100 * FP32_ATOL)
    assert changed, "the adapter does not change the model: the test could not tell"


# --- adapters and the base model in one batch ----------------------------------------------

MIXED_SETTINGS = {
    "default": {},
    # a 16-token budget: prompts prefill in chunks while other rows decode
    "chunked": dict(max_num_batched_tokens=16, max_num_seqs=8),
    "async": dict(async_scheduling=True),
    "eager": dict(enforce_eager=True),
}


@pytest.mark.parametrize("setting", list(MIXED_SETTINGS))
def test_mixed_batch_equals_each_alone(setting, base, trio, make_llm):
    a, b, _ = trio
    llm = make_llm(max_loras=2, **MIXED_SETTINGS[setting])
    ra, rb = a.request("a", 1), b.request("b", 2)
    prompts = PROMPTS + PROMPTS[::-1]
    loras = [ra, None, rb, ra, rb, None]
    adapters = {id(ra): a, id(rb): b}
    expected = [adapters[id(lora)].reference(p) if lora is not None else base_reference(base, p)
                for p, lora in zip(prompts, loras)]
    assert run(llm, prompts, loras) == expected
    if setting == "default":  # and each alone, on the same engine
        assert [run(llm, [p], lora)[0] for p, lora in zip(prompts, loras)] == expected
    assert len({tuple(t) for t in expected}) == len(expected)  # every row is told apart


def spy_on_adapters_per_step(llm: LLM) -> list[list[str | None]]:
    """Record, per scheduled step, the adapter (None: the base model) of each sequence it runs."""
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    steps: list[list[str | None]] = []

    def spy():
        plan = schedule()
        steps.append([None if s.seq.lora is None else s.seq.lora.name for s in plan.scheduled])
        return plan

    scheduler.schedule = spy
    return steps


@pytest.mark.parametrize("num_kv_blocks", [64, 6])
def test_more_adapters_than_slots(num_kv_blocks, base, trio, make_llm):
    """One slot, three adapters and the base model interleaved: the scheduler passes over
    requests whose adapter cannot join the batch and the slot is reloaded as adapters take
    turns; with 6 blocks (of 16) sequences are also preempted and recomputed."""
    llm = make_llm(max_loras=1, num_kv_blocks=num_kv_blocks)
    steps = spy_on_adapters_per_step(llm)
    requests = [t.request(name, i + 1) for i, (name, t) in enumerate(zip("abc", trio))]
    prompts = [PROMPTS[i % 3] for i in range(8)]
    picks = [0, 1, None, 2, 0, None, 1, 2]
    loras = [None if k is None else requests[k] for k in picks]
    expected = [base_reference(base, p) if k is None else trio[k].reference(p)
                for p, k in zip(prompts, picks)]
    assert run(llm, prompts, loras) == expected
    assert all(len(set(step) - {None}) <= 1 for step in steps)
    assert {name for step in steps for name in step} == {"a", "b", "c", None}
    # the first step passes over b; behind it only the base model's requests go ahead (the
    # second request of a waits, or a stream of them could starve b): with 64 blocks a and
    # both base requests run, with 6 only a and the first base request fit
    assert steps[0].count("a") == 1 and steps[0].count(None) == (2 if num_kv_blocks == 64 else 1)
    if num_kv_blocks == 6:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.all_free()



def test_a_stream_of_one_adapter_cannot_starve_another(trio, make_llm):
    """One slot: while b waits for it, new requests of a (which holds it) queue behind b
    instead of keeping a's slot taken forever; the base model's still go ahead."""
    llm = make_llm(max_loras=1)
    engine = llm.engine
    requests = [t.request(name, i + 1) for i, (name, t) in enumerate(zip("ab", trio))]
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    engine.add_request("a-0", PROMPTS[0], params, requests[0])
    engine.add_request("b", PROMPTS[1], params, requests[1])
    finished: dict[str, int] = {}
    for step in range(200):
        if step % 3 == 0:  # a new request of a every third step, and one of the base model
            engine.add_request(f"a-{step + 1}", PROMPTS[0], params, requests[0])
            engine.add_request(f"base-{step + 1}", PROMPTS[2], params)
        finished.update((out.request_id, step) for out in engine.step() if out.finished)
        if "b" in finished:
            break
    assert "b" in finished and finished["b"] < 40
    assert any(r.startswith("base-") and s < finished["b"] for r, s in finished.items())
    for request_id in list(engine.requests):
        engine.abort(request_id)
    check_idle(llm)


# --- the prefix cache ----------------------------------------------------------------------

def test_prefix_cache_is_never_shared_across_adapters(base, trio, make_llm):
    a, b, _ = trio
    llm = make_llm(max_loras=2, block_size=16)
    prompt = prompt_ids(70, seed=99)  # 4 full blocks of 16, then 6 tokens
    ra, rb = a.request("a", 1), b.request("b", 2)
    cold = {None: base_reference(base, prompt), "a": a.reference(prompt), "b": b.reference(prompt)}
    assert len({tuple(v) for v in cold.values()}) == 3

    def hits() -> int:
        return llm.engine.stats().prefix_cache_hits

    for lora, key in ((None, None), (ra, "a"), (rb, "b")):
        assert run(llm, [prompt], lora) == [cold[key]]
    assert hits() == 0, "KV computed for one adapter (or the base) was reused for another"
    for lora, key in ((None, None), (ra, "a"), (rb, "b")):  # within one adapter it is reused
        before = hits()
        assert run(llm, [prompt], lora) == [cold[key]]
        assert hits() - before == 64
    # a name loaded again from another folder is another adapter: none of the old KV
    assert llm.engine.remove_lora("a")
    before = hits()
    assert run(llm, [prompt], b.request("a", 1)) == [cold["b"]]
    assert hits() == before


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


# --- with other features -------------------------------------------------------------------

def test_tensor_parallel_mixed_batch_equals_one_process(base, trio, make_adapter):
    k_only = make_adapter(seed=11, **PARITY_CASES["k_only"])
    adapters = [*trio, k_only]
    requests = [t.request(name, i + 1) for i, (name, t) in enumerate(zip("abck", adapters))]
    prompts = [PROMPTS[i % 3] for i in range(8)]
    picks = [0, 1, None, 2, 3, None, 1, 0]
    loras = [None if k is None else requests[k] for k in picks]
    expected = [base_reference(base, p) if k is None else adapters[k].reference(p)
                for p, k in zip(prompts, picks)]
    # two slots for four adapters: ranks other than the driver reload slots too
    with LLM(base[0], dtype="float32", num_kv_blocks=64, show_progress=False, tensor_parallel_size=2,
             enable_lora=True, max_loras=2) as llm:
        assert llm.engine.tp_group.world_size == 2
        assert run(llm, prompts, loras) == expected
        check_idle(llm)


def test_speculative_decoding_with_adapters_equals_plain_decoding(base, trio, make_llm):
    a, b, _ = trio
    prompts = [[5, 6, 7, 8, 9] * 6, [40, 41, 42] * 7, PROMPTS[1]]
    loras = [a.request("a", 1), b.request("b", 2), None]
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    plain = run(make_llm(max_loras=2), prompts, loras, params)
    spec = make_llm(max_loras=2, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                     "disable_by_batch_size": None})
    assert run(spec, prompts, loras, params) == plain
    assert plain == [a.reference(prompts[0], 24), b.reference(prompts[1], 24), base_reference(base, prompts[2], 24)]
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > 0, "no draft was accepted: nothing was verified"


def sampled(seed: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, max_new_tokens=NEW_TOKENS, temperature=1.0, seed=seed, ignore_eos=True)


def test_seeded_sampling_with_an_adapter_is_reproducible(trio, make_llm):
    a, b, _ = trio
    prompts = PROMPTS[:2]
    first = run(make_llm(max_loras=2), prompts, a.request("a"), sampled(1234))
    mixed = run(make_llm(max_loras=2), prompts * 2, [a.request("a"), a.request("a"), None, None], sampled(1234))
    assert mixed[:2] == first
    assert mixed[2:] != first  # the base model samples other tokens from the same seeds
    assert run(make_llm(max_loras=2), prompts, b.request("b"), sampled(1234)) != first
    # n = 2: the second sequence (seed + 1) joins once the first has computed the prompt,
    # and runs with the adapter too
    llm = make_llm(max_loras=2)
    pair = llm.generate(prompts[:1], sampled(1234, n=2), lora_request=a.request("a"))[0]
    second = run(llm, prompts[:1], a.request("a"), sampled(1235))[0]
    assert [c.token_ids for c in pair.outputs] == [first[0], second]
    assert second != run(llm, prompts[:1], None, sampled(1235))[0]
