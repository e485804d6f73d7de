"""Post-norm rotary encoders (NomicBERT: nomic-embed-text; GTE: gte-multilingual-base and
its reranker) as embedding models and cross-encoders, from the checkpoints transformers
writes (the families' own tensor names); equal to transformers' NomicBertModel / GteModel
and their *ForSequenceClassification."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tessera import LLM
from tests.conftest import TINY_CORPUS
from tests.pooling.checkpoints import make_rotary_encoder
from tests.pooling.test_encoders import token_prompts
from tests.pooling.test_modernbert import pooled

ATOL = 1e-5
QUERY = "What stores the KV cache?"
DOCS = ["Paged attention stores the KV cache in fixed-size blocks", "The quick brown fox", "hello world"]


@pytest.mark.parametrize("family", ["nomic", "gte"])
@pytest.mark.parametrize("pooling", ["CLS", "MEAN"])
def test_rotary_encoder_embeddings_equal_transformers(tmp_path, family, pooling):
    hf = make_rotary_encoder(tmp_path, family, TINY_CORPUS, pooling)
    batch = token_prompts(8, hf.config.vocab_size, seed=1, hi=200)
    with LLM(tmp_path, dtype="float32", show_progress=False, max_num_batched_tokens=64) as llm:
        assert llm.engine.is_pooling and llm.engine.max_model_len == 256
        for ids, out in zip(batch, llm.embed(batch)):
            torch.testing.assert_close(out.outputs.data, pooled(hf, ids, pooling), atol=ATOL, rtol=0)
        text, = llm.embed(DOCS[:1])
        ids = list(llm.tokenizer(DOCS[0]).input_ids)
        torch.testing.assert_close(text.outputs.data, pooled(hf, ids, pooling), atol=ATOL, rtol=0)


def test_gte_without_token_types_and_bfloat16(tmp_path):
    hf = make_rotary_encoder(tmp_path, "gte", TINY_CORPUS, type_vocab_size=0)  # no files: CLS, normalized
    assert hf.embeddings.token_type_embeddings is None
    batch = token_prompts(4, hf.config.vocab_size, seed=3, lo=10, hi=120)
    with LLM(tmp_path, dtype="float32", show_progress=False) as llm:
        assert llm.engine.pooler_config.pooling_type == "CLS"
        for ids, out in zip(batch, llm.embed(batch)):
            torch.testing.assert_close(out.outputs.data, pooled(hf, ids, "CLS"), atol=ATOL, rtol=0)
    with LLM(tmp_path, dtype="bfloat16", show_progress=False) as llm:
        for ids, out in zip(batch, llm.embed(batch)):
            assert F.cosine_similarity(out.outputs.data, pooled(hf, ids, "CLS"), dim=0) >= 1 - 1e-3


REMOTE_CODE_KEYS = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
                    "intermediate_size": "n_inner", "layer_norm_eps": "layer_norm_epsilon",
                    "max_position_embeddings": "max_trained_positions"}


def as_remote_code_config(folder, config: dict, **extra) -> None:
    """Write config.json in the keys nomic-ai's folders use (their remote code's), with the
    values of transformers' `config`; transformers' defaults for the remote-code keys are
    nomic-embed-text-v1.5's (768 wide, 12 layers), not these."""
    remote = {key: config[name] for name, key in REMOTE_CODE_KEYS.items()}
    remote.update(model_type="nomic_bert", architectures=["NomicBertModel"], vocab_size=config["vocab_size"],
                  type_vocab_size=config["type_vocab_size"], activation_function="swiglu", prenorm=False,
                  rotary_emb_base=1000, rotary_emb_fraction=1.0, rotary_emb_interleaved=False, qkv_proj_bias=False,
                  mlp_fc1_bias=False, mlp_fc2_bias=False, use_rms_norm=False, rotary_scaling_factor=None,
                  n_positions=8192, pad_token_id=0)
    remote.update(extra)
    (folder / "config.json").write_text(json.dumps(remote))


def test_nomic_folders_in_the_remote_code_keys(tmp_path):
    hf = make_rotary_encoder(tmp_path, "nomic", TINY_CORPUS, "MEAN")
    config = json.loads((tmp_path / "config.json").read_text())
    as_remote_code_config(tmp_path, config)
    batch = token_prompts(4, hf.config.vocab_size, seed=2, hi=150)
    with LLM(tmp_path, dtype="float32", show_progress=False) as llm:
        assert llm.engine.max_model_len == 256 and llm.engine.router.config.hidden_size == 64
        for ids, out in zip(batch, llm.embed(batch)):
            torch.testing.assert_close(out.outputs.data, pooled(hf, ids, "MEAN"), atol=ATOL, rtol=0)
    from tessera.config import ModelConfig
    from tessera.inspection import inspect_model

    info = inspect_model(ModelConfig(model=str(tmp_path), dtype="float32"))  # loads every tensor
    assert info["router"] == "NomicBertRouter" and info["config"]["hidden_size"] == 64
    as_remote_code_config(tmp_path, config, prenorm=True)
    with pytest.raises(ValueError, match="prenorm=True is not supported"):
        LLM(tmp_path, dtype="float32", show_progress=False)
    as_remote_code_config(tmp_path, config, moe_every_n_layers=2)  # nomic-embed-text-v2-moe
    with pytest.raises(ValueError, match="moe_every_n_layers=2 is not supported"):
        LLM(tmp_path, dtype="float32", show_progress=False)


@pytest.mark.parametrize("family, prefix", [("nomic", None), ("gte", None), ("gte", "new.")])
def test_rotary_cross_encoder_scores_equal_transformers(tmp_path, family, prefix):
    """A pair's second text in segment 1, the head over the first row; GTE's classifiers
    also name the backbone new. (Alibaba's own checkpoints)."""
    hf = make_rotary_encoder(tmp_path, family, TINY_CORPUS, num_labels=1)
    if prefix is not None:
        path = tmp_path / "model.safetensors"
        tensors = load_file(path)
        save_file({prefix + k.removeprefix("gte.") if k.startswith("gte.") else k: v for k, v in tensors.items()},
                  path, metadata={"format": "pt"})
    with LLM(tmp_path, dtype="float32", show_progress=False, max_num_seqs=2) as llm:
        assert llm.engine.pooler_config.task == "classify" and llm.engine.pooler_config.pair_segments
        for doc, out in zip(DOCS, llm.score(QUERY, DOCS)):
            encoded = llm.tokenizer(QUERY, doc, return_token_type_ids=True, return_tensors="pt")
            assert set(encoded.token_type_ids[0].tolist()) == {0, 1}
            with torch.no_grad():
                expected = torch.sigmoid(hf(**encoded).logits[0, 0]).item()
            assert out.outputs.score == pytest.approx(expected, abs=1e-5)


def as_alibaba_config(folder, config: dict, architecture: str = "NewModel", **extra) -> None:
    """Write config.json as Alibaba's GTE folders have it: the remote-code type `new`."""
    keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
            "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "pad_token_id", "id2label", "label2id")
    remote = {key: config[key] for key in keys if key in config}
    remote.update(model_type="new", architectures=[architecture], position_embedding_type="rope",
                  layer_norm_type="layer_norm", pack_qkv=True, logn_attention_scale=False, logn_attention_clip1=False,
                  unpad_inputs=False, use_memory_efficient_attention=False,
                  rope_theta=config["rope_parameters"]["rope_theta"], rope_scaling=None,
                  auto_map={"AutoConfig": "Alibaba-NLP/new-impl--configuration.NewConfig"})
    remote.update(extra)
    (folder / "config.json").write_text(json.dumps(remote))


def ntk_scaled(hf, factor: float) -> None:
    """transformers' GteModel with the remote code's fixed NTK rotary: base * factor, each
    frequency divided by factor ** (2 / head_dim) (as vLLM's NTKScalingRotaryEmbedding)."""
    rotary = hf.rotary_emb
    dim = 2 * rotary.inv_freq.numel()
    base = hf.config.rope_parameters["rope_theta"] * factor
    rotary.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)) / factor ** (2 / dim)


def test_gte_folders_as_alibaba_publishes_them(tmp_path):
    """gte-base-en-v1.5's shape: type `new`, no token types, fixed NTK rotary (factor 2);
    equal to transformers with the remote code's frequencies, which differ from plain ones."""
    hf = make_rotary_encoder(tmp_path, "gte", TINY_CORPUS, type_vocab_size=0)
    batch = token_prompts(4, hf.config.vocab_size, seed=4, lo=60, hi=200)
    plain = [pooled(hf, ids, "CLS") for ids in batch]
    ntk_scaled(hf, 2.0)
    as_alibaba_config(tmp_path, json.loads((tmp_path / "config.json").read_text()),
                      rope_scaling={"type": "ntk", "factor": 2.0})
    with LLM(tmp_path, dtype="float32", show_progress=False) as llm:
        assert llm.engine.router.config.model_type == "gte"
        for ids, out, unscaled in zip(batch, llm.embed(batch), plain):
            want = pooled(hf, ids, "CLS")
            torch.testing.assert_close(out.outputs.data, want, atol=ATOL, rtol=0)
            assert (want - unscaled).abs().max() > 1e-3


def test_gte_rerankers_as_alibaba_publishes_them(tmp_path):
    """gte-multilingual-reranker-base's shape: NewForSequenceClassification, its backbone
    under new., plain rotary."""
    hf = make_rotary_encoder(tmp_path, "gte", TINY_CORPUS, num_labels=1)
    path = tmp_path / "model.safetensors"
    save_file({"new." + k.removeprefix("gte.") if k.startswith("gte.") else k: v for k, v in load_file(path).items()},
              path, metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    as_alibaba_config(tmp_path, config, "NewForSequenceClassification")
    with LLM(tmp_path, dtype="float32", show_progress=False) as llm:
        for doc, out in zip(DOCS, llm.score(QUERY, DOCS)):
            encoded = llm.tokenizer(QUERY, doc, return_token_type_ids=True, return_tensors="pt")
            with torch.no_grad():
                expected = torch.sigmoid(hf(**encoded).logits[0, 0]).item()
            assert out.outputs.score == pytest.approx(expected, abs=1e-5)
    for extra, refused in [({"logn_attention_scale": True}, "logn_attention_scale=True is not supported"),
                           ({"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 0.5}}, "rope_scaling"),
                           ({"architectures": ["NewForTokenClassification"]}, "NewForTokenClassification")]:
        as_alibaba_config(tmp_path, config, "NewForSequenceClassification", **extra)
        with pytest.raises(ValueError, match=refused):
            LLM(tmp_path, dtype="float32", show_progress=False)
