"""GGUF loading, end to end, on real GGUF files written here from tiny random Llamas.

Each file is written the way llama.cpp's convert_hf_to_gguf.py writes a Llama: llama.* metadata,
a byte-level BPE ("gpt2") vocabulary with its merges, tensors under llama.cpp names, the rows of
Q and K permuted into llama.cpp's interleaved rotary layout (`LlamaModel.permute`), norms kept in
F32 and every 2-D weight stored in one of F32, F16, BF16, Q8_0, Q4_0, Q4_1 (quantized with the
`gguf` package's own reference quantizers).

Three independent checks per type:
  (a) every loaded parameter equals `dequantize(quantize(w))` of the original Hugging Face weight,
      bit for bit; the expected values are computed from the unpermuted HF weights (quantization
      blocks lie along rows, so permuting rows commutes with the round trip), so a wrong name
      mapping or a wrong un-permutation of Q/K shows up here;
  (b) greedy tokens equal transformers' `generate` on an HF LlamaForCausalLM holding those same
      dequantized weights (for F32: the original model itself);
  (c) transformers loads the same file itself (its own reader and its own un-permutation) to the
      same weights and gives the same greedy tokens as tessera.
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tessera.sampling.params import SamplingParams
from tessera.weights.gguf import iter_gguf_weights
from tests.weights.gguf_writer import (CHAT_TEMPLATE, CONTEXT, llama_cpp_permute, round_trip, storage_type,
                                     write_llama_gguf)

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 512  # rows of 64/128: 32-blocks
HEAD_DIM = HIDDEN // HEADS
INIT_RANGE = 0.1      # logits spread over a few units, so greedy margins dwarf float32 noise
NUM_KV_BLOCKS = 64
NEW_TOKENS = 16
QTYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
CASES = (*QTYPES, "Q8_0-tied")  # tied: llama.cpp writes no output.weight

def tiny_llama(make_tiny_llama, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random HF Llama with bold init and random norm weights (and biases), so a unit
    norm or a zero bias cannot hide a loader that skips it."""
    _, model = make_tiny_llama(seed=seed, initializer_range=INIT_RANGE, **overrides)
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


def expected_weights(model: torch.nn.Module, qtype: QT) -> dict[str, torch.Tensor]:
    """HF name -> the float32 values a correct loader produces (from the unpermuted weights)."""
    out = {}
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        out[name] = torch.from_numpy(round_trip(array, storage_type(array, qtype)).copy())
    return out


def with_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(weights[name])
    return ref.eval()


def unpacked_state(llm: LLM) -> dict[str, torch.Tensor]:
    """tessera's loaded parameters under Hugging Face names (packed QKV / gate-up split back)."""
    model = llm.engine.model
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    out = {"model.embed_tokens.weight": model.model.embed_tokens.weight,
           "model.norm.weight": model.model.norm.weight,
           "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.model.layers):
        p = f"model.layers.{i}"
        qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
        out |= {f"{p}.self_attn.q_proj.weight": qkv[:q], f"{p}.self_attn.k_proj.weight": qkv[q:q + kv],
                f"{p}.self_attn.v_proj.weight": qkv[q + kv:],
                f"{p}.self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
                f"{p}.mlp.gate_proj.weight": gate_up[:INTER], f"{p}.mlp.up_proj.weight": gate_up[INTER:],
                f"{p}.mlp.down_proj.weight": layer.mlp.down_proj.weight,
                f"{p}.input_layernorm.weight": layer.input_layernorm.weight,
                f"{p}.post_attention_layernorm.weight": layer.post_attention_layernorm.weight}
    return {k: v.detach() for k, v in out.items()}


def greedy(n: int = NEW_TOKENS) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def hf_generate(model: torch.nn.Module, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompt_ids(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 * seed + length)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


PROMPTS = [prompt_ids(7, 1), prompt_ids(23, 2)]  # inside one block, across a block boundary


def load(path: Path, cache_dir: Path) -> LLM:
    return LLM(path, dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, show_progress=False,
               cache_dir=cache_dir)


@dataclass
class Case:
    name: str
    qtype: QT
    path: Path
    hf: torch.nn.Module              # the original HF model, float32
    expected: dict[str, torch.Tensor]
    llm: LLM
    _ref: torch.nn.Module | None = field(default=None, repr=False)

    @property
    def ref(self) -> torch.nn.Module:
        """HF Llama holding the dequantized weights: what the file really contains."""
        if self._ref is None:
            self._ref = with_weights(self.hf, self.expected)
        return self._ref


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


@pytest.fixture(scope="module")
def tokenizer_json(tiny_tokenizer_dir) -> Path:
    return Path(tiny_tokenizer_dir) / "tokenizer.json"


@pytest.fixture(scope="module")
def models(make_tiny_llama) -> dict[str, torch.nn.Module]:
    return {"untied": tiny_llama(make_tiny_llama, seed=3),
            "tied": tiny_llama(make_tiny_llama, seed=4, tie_word_embeddings=True)}


@pytest.fixture(scope="module")
def build_case(models, tokenizer_json, tmp_path_factory):
    built: dict[str, Case] = {}

    def build(name: str) -> Case:
        if name not in built:
            qtype = QT[name.removesuffix("-tied")]
            hf = models["tied" if name.endswith("-tied") else "untied"]
            folder = tmp_path_factory.mktemp(f"gguf-{name}")
            path = write_llama_gguf(folder / f"tiny-{name}.gguf", hf, tokenizer_json, qtype)
            llm = load(path, tmp_path_factory.mktemp("cache"))
            built[name] = Case(name, qtype, path, hf, expected_weights(hf, qtype), llm)
        return built[name]

    return build


@pytest.fixture(scope="module", params=CASES)
def case(request, build_case) -> Case:
    return build_case(request.param)


# --- (a) weights --------------------------------------------------------------------------------

def test_file_is_written_as_llama_cpp_does(case: Case):
    """Sanity of the writer: the types are the ones asked for and Q/K are stored permuted, so
    the loader tests below are not vacuous."""
    reader = gguf.GGUFReader(str(case.path))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == case.qtype
    assert types["token_embd.weight"] == case.qtype
    assert types["blk.1.ffn_norm.weight"] == QT.F32
    assert ("output.weight" in types) == (not case.hf.config.tie_word_embeddings)
    for name, hf_name, heads in (("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj.weight", HEADS),
                                 ("blk.1.attn_k.weight", "model.layers.1.self_attn.k_proj.weight", KV_HEADS)):
        tensor = next(t for t in reader.tensors if t.name == name)
        stored = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(case.expected[hf_name].shape)
        want = case.expected[hf_name].numpy()
        assert np.array_equal(stored, llama_cpp_permute(want, heads))
        assert not np.array_equal(stored, want)


def test_loaded_weights_equal_dequantized_originals(case: Case):
    got = unpacked_state(case.llm)
    expected = dict(case.expected)  # tied: lm_head.weight is the (round-tripped) embedding
    assert set(got) == set(expected)
    # Q and K first, row by row, naming the original row each loaded row really holds: a missing
    # or wrong un-permutation (or one with the wrong head count) reads as a row shuffle here.
    for i in range(LAYERS):
        for proj, heads in (("q_proj", HEADS), ("k_proj", KV_HEADS)):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            rows_got, rows_want = got[name], expected[name]
            assert rows_got.shape == (heads * HEAD_DIM, HIDDEN)
            for r in range(rows_want.shape[0]):
                if not torch.equal(rows_got[r], rows_want[r]):
                    holds = [j for j in range(rows_want.shape[0]) if torch.equal(rows_got[r], rows_want[j])]
                    pytest.fail(f"{case.name}: {name} row {r} holds original row(s) {holds}")
    for name, want in expected.items():
        assert got[name].dtype == torch.float32
        assert got[name].shape == want.shape, name
        assert torch.equal(got[name], want), f"{case.name}: {name} differs"
    if case.qtype != QT.F32:  # the round trip really is lossy, so (b) below is not trivial
        original = case.hf.state_dict()["model.layers.0.self_attn.q_proj.weight"]
        assert not torch.equal(expected["model.layers.0.self_attn.q_proj.weight"], original)


def test_iter_gguf_weights_names_and_shapes(case: Case):
    config = case.llm.engine.router.config
    got = dict(iter_gguf_weights(case.path, permute_qk=True, num_heads=config.num_attention_heads,
                                 num_kv_heads=config.num_key_value_heads))
    want = {k: v for k, v in case.expected.items()
            if not (k == "lm_head.weight" and case.hf.config.tie_word_embeddings)}
    assert set(got) == set(want)
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous()
        assert torch.equal(tensor, want[name]), name
    # The returned tensors own writable memory, not views of the read-only memory map.
    t = got["model.layers.0.input_layernorm.weight"]
    t.add_(1.0)


# --- (b) greedy against transformers on the same weights ------------------------------------

def test_greedy_matches_transformers_on_dequantized_weights(case: Case):
    outs = case.llm.generate(PROMPTS, greedy(), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_generate(case.ref, p) for p in PROMPTS]
    if case.qtype == QT.F32:
        assert got == [hf_generate(case.hf, p) for p in PROMPTS]


# --- (c) transformers' own GGUF loader ---------------------------------------------------------

def test_transformers_loads_the_same_file_to_the_same_tokens(case: Case):
    from transformers import AutoModelForCausalLM

    hf_gguf = AutoModelForCausalLM.from_pretrained(str(case.path.parent), gguf_file=case.path.name,
                                                   dtype=torch.float32).eval()
    state = hf_gguf.state_dict()
    for name, want in case.expected.items():
        assert torch.equal(state[name], want), f"transformers' {name} differs"
    outs = case.llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_generate(hf_gguf, p) for p in PROMPTS]


# --- config, tokenizer and chat template from the GGUF metadata ----------------------------------

def test_metadata_converted_from_gguf(build_case, tiny_tokenizer_dir):
    """Config, tokenizer, chat template and EOS all come from the file's metadata (converted by
    transformers); checked on one type, as they do not depend on it."""
    from transformers import AutoTokenizer

    case = build_case("Q4_0")
    router = case.llm.engine.router
    cfg = router.config
    assert cfg.model_type == "llama"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (HIDDEN, INTER, LAYERS)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (HEADS, KV_HEADS, VOCAB)
    assert cfg.max_position_embeddings == CONTEXT
    assert not cfg.tie_word_embeddings
    assert 2 in router.eos_token_ids
    assert router.chat_template == CHAT_TEMPLATE
    text = "The quick brown fox jumps over the lazy dog. Café 你好 🙂\ndef fibonacci(n):"
    original = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    ids = original(text).input_ids
    assert list(case.llm.tokenizer(text).input_ids) == ids
    assert case.llm.tokenizer.decode(ids) == text
    out = case.llm.generate(text, greedy(), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == hf_generate(case.ref, ids)
    chat = case.llm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == original("<s>user: hi\n<s>assistant:", add_special_tokens=False).input_ids


# --- errors -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def untied(models) -> torch.nn.Module:
    return models["untied"]


@pytest.mark.parametrize("bad_name", ["blk.0.attn_fancy.weight", "mystery_tensor.weight"])
def test_unknown_tensor_name_is_a_clear_error(bad_name, untied, tokenizer_json, tmp_path):
    path = write_llama_gguf(tmp_path / "unknown.gguf", untied, tokenizer_json, QT.F32,
                            extra_tensors={bad_name: np.ones(HIDDEN)})
    with pytest.raises((KeyError, ValueError), match=re.escape(bad_name)):
        load(path, tmp_path / "cache")


def test_chat_end_markers_end_generation(untied, tokenizer_json, tmp_path):
    """A GGUF carries one EOS id; like llama.cpp, the vocabulary's end-of-turn markers
    (Gemma's <end_of_turn>, Phi-3's <|end|>, ...) end generation too."""
    markers = {VOCAB - 1: "<end_of_turn>", VOCAB - 2: "<|end|>"}
    path = write_llama_gguf(tmp_path / "chat.gguf", untied, tokenizer_json, QT.F32, token_overrides=markers)
    llm = load(path, tmp_path / "cache")
    assert set(markers) | {2} <= llm.engine.router.eos_token_ids
    for token in markers:
        out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0.0, logit_bias={token: 100.0}),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [token] and out.finish_reason == "eos_token"
    plain = load(write_llama_gguf(tmp_path / "plain.gguf", untied, tokenizer_json, QT.F32), tmp_path / "cache2")
    assert not set(markers) & plain.engine.router.eos_token_ids


def test_architecture_tessera_does_not_serve(untied, tokenizer_json, tmp_path):
    """transformers converts a stablelm GGUF's metadata fine; tessera has no stablelm folder,
    and the transformers fallback does not take GGUF files."""
    from tessera.models.registry import UnsupportedModelError

    path = write_llama_gguf(tmp_path / "stablelm.gguf", untied, tokenizer_json, QT.F32, arch="stablelm")
    with pytest.raises(UnsupportedModelError, match=r"'stablelm'.*GGUF files load only.*\bllama\b"):
        load(path, tmp_path / "cache")


def test_missing_tensor_is_an_error_naming_it(untied, tokenizer_json, tmp_path):
    path = write_llama_gguf(tmp_path / "short.gguf", untied, tokenizer_json, QT.F32,
                            skip=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match=re.escape("model.layers.1.mlp.down_proj.weight")):
        load(path, tmp_path / "cache")


def test_split_and_truncated_files_are_named_as_such(untied, tokenizer_json, tmp_path):
    split = write_llama_gguf(tmp_path / "llama-00001-of-00003.gguf", untied, tokenizer_json, QT.F32,
                             extra_metadata={"split.count": 3})
    with pytest.raises(ValueError, match="one of 3 parts of a split GGUF.*llama-gguf-split --merge"):
        load(split, tmp_path / "cache")
    whole = write_llama_gguf(tmp_path / "whole.gguf", untied, tokenizer_json, QT.F32)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load(cut, tmp_path / "cache")


# --- attention biases (llama.cpp permutes q/k biases too) ---------------------------------------

@pytest.fixture(scope="module")
def bias_gguf(make_tiny_llama, tokenizer_json, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    model = tiny_llama(make_tiny_llama, seed=5, attention_bias=True)
    path = write_llama_gguf(tmp_path_factory.mktemp("gguf-bias") / "bias.gguf", model,
                            tokenizer_json, QT.F32)
    return path, model


def test_q_and_k_biases_are_unpermuted(bias_gguf):
    path, model = bias_gguf
    got = dict(iter_gguf_weights(path, permute_qk=True, num_heads=HEADS, num_kv_heads=KV_HEADS))
    state = model.state_dict()
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                       state["model.layers.0.self_attn.q_proj.weight"])
    for name in ("model.layers.0.self_attn.v_proj.bias", "model.layers.0.self_attn.q_proj.bias",
                 "model.layers.0.self_attn.k_proj.bias"):
        assert torch.equal(got[name], state[name]), name


def test_llama_with_attention_bias_from_gguf(bias_gguf, tmp_path):
    path, model = bias_gguf
    llm = load(path, tmp_path / "cache")
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_generate(model, p) for p in PROMPTS]


def test_architecture_nobody_reads_is_named_with_what_tessera_reads(untied, tokenizer_json, tmp_path):
    """A file of an arch neither transformers' conversion nor tessera reads (Jamba's,
    say) names the arch and lists the ones tessera does."""
    path = write_llama_gguf(tmp_path / "hybrid.gguf", untied, tokenizer_json, QT.F32, arch="jamba")
    with pytest.raises(ValueError, match=r"'jamba' is not read by tessera \(it reads .*deepseek2.*\)"):
        load(path, tmp_path / "cache")
