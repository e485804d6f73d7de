"""Tiny random embedding checkpoints: a transformers backbone saved bare (as Qwen3-Embedding
and e5-mistral are: no `model.` prefix, no LM head) with sentence-transformers' module files,
and transformers' own pooled vectors to compare against."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

BACKBONE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
ST_MODULES = "sentence_transformers.models."
POOLING_FLAGS = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}


@dataclass
class Embedder:
    folder: Path
    hf: torch.nn.Module  # transformers' backbone, float32, eval
    pooling: str
    normalize: bool

    def reference(self, token_ids: list[int], pooling: str | None = None, normalize: bool | None = None,
                  dimensions: int | None = None) -> torch.Tensor:
        """transformers' pooled vector for one prompt (float32)."""
        with torch.no_grad():
            hidden = self.hf(torch.tensor([token_ids])).last_hidden_state[0].float()
        kind = pooling or self.pooling
        vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]
        if dimensions is not None:
            vector = vector[:dimensions]
        return F.normalize(vector, dim=-1) if (self.normalize if normalize is None else normalize) else vector


def write_sentence_transformers(folder: Path, pooling: str | None, normalize: bool, extra: list[dict] = ()) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": ST_MODULES + "Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": ST_MODULES + "Pooling"})
        (folder / "1_Pooling").mkdir(exist_ok=True)
        flags = {flag: kind == pooling for kind, flag in POOLING_FLAGS.items()}
        (folder / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **flags}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": ST_MODULES + "Normalize"})
    (folder / "modules.json").write_text(json.dumps([*modules, *extra]))


def embedder_factory(tmp_path_factory, tiny_tokenizer_dir: Path) -> Callable[..., Embedder]:
    """make_embedder(arch="qwen3" | "llama", pooling="LAST", normalize=True,
    sentence_transformers=True, prompts=None (named prompts), **config_overrides)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaModel, Qwen3Config, Qwen3Model

    made: dict = {}

    def make(arch: str = "qwen3", pooling: str = "LAST", normalize: bool = True,
             sentence_transformers: bool = True, seed: int = 0, prompts: dict | None = None,
             **overrides) -> Embedder:
        key = (arch, pooling, normalize, sentence_transformers, seed, tuple(sorted((prompts or {}).items())),
               tuple(sorted(overrides.items())))
        if key in made:
            return made[key]
        config_cls, model_cls = {"qwen3": (Qwen3Config, Qwen3Model), "llama": (LlamaConfig, LlamaModel)}[arch]
        extra = {"head_dim": 16} if arch == "qwen3" else {}
        torch.manual_seed(seed)
        model = model_cls(config_cls(**{**BACKBONE, **extra, **overrides})).eval()
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():  # norms around 1: a loader that skipped them would show
            for name, p in model.named_parameters():
                if "norm" in name and name.endswith(".weight"):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        folder = tmp_path_factory.mktemp(f"embed-{arch}")
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(folder)
        if sentence_transformers:
            write_sentence_transformers(folder, pooling, normalize)
        if prompts:
            (folder / "config_sentence_transformers.json").write_text(json.dumps({"prompts": prompts}))
        made[key] = Embedder(folder, model, pooling, normalize)
        return made[key]

    return make


ENCODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               hidden_act="gelu", layer_norm_eps=1e-12)


def write_wordpiece_tokenizer(folder: Path, corpus: list[str], second_segment: int = 1) -> int:
    """A BERT-style tokenizer ([CLS] text [SEP]) trained on `corpus`, a pair's second text of
    segment `second_segment` (0 as RoBERTa's tokenizers give); returns its vocabulary size."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair=f"[CLS] $A [SEP] $B:{second_segment} [SEP]:{second_segment}",
        special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                            sep_token="[SEP]", mask_token="[MASK]").save_pretrained(folder)
    return tok.get_vocab_size()


def make_encoder(folder: Path, kind: str, pooling: str | None, normalize: bool, corpus: list[str],
                 seed: int = 0, **overrides) -> Embedder:
    """A tiny random BERT or XLM-RoBERTa saved bare (as sentence-transformers saves them)."""
    from transformers import BertConfig, BertModel, XLMRobertaConfig, XLMRobertaModel

    vocab = write_wordpiece_tokenizer(folder, corpus)
    torch.manual_seed(seed)
    if kind == "bert":
        config = BertConfig(vocab_size=vocab, max_position_embeddings=128, type_vocab_size=2, pad_token_id=0,
                            **{**ENCODER, **overrides})
        model = BertModel(config, add_pooling_layer=True)
    else:  # positions from padding_idx + 1 = 2
        config = XLMRobertaConfig(vocab_size=vocab, max_position_embeddings=130, type_vocab_size=1,
                                  pad_token_id=1, **{**ENCODER, **overrides})
        model = XLMRobertaModel(config, add_pooling_layer=False)
    nudge_norms_and_biases(model.eval(), seed, "LayerNorm")
    model.save_pretrained(folder)
    if pooling is not None:
        write_sentence_transformers(folder, pooling, normalize)
    return Embedder(folder, model, pooling or "CLS", normalize)


def nudge_norms_and_biases(model: torch.nn.Module, seed: int, norm_marker: str,
                           scales: dict[str, float] | None = None) -> None:
    """Norms (names holding `norm_marker`) and biases away from their 1 / 0 defaults, so a
    loader that skipped one would show; then parameters whose name holds a key of `scales`
    multiplied by its value."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 3)
        for name, p in model.named_parameters():
            if norm_marker in name or name.endswith(".bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            for part, scale in (scales or {}).items():
                if part in name:
                    p.mul_(scale)


def make_cross_encoder(folder: Path, kind: str, corpus: list[str], num_labels: int = 1, seed: int = 0,
                       **config_extra) -> torch.nn.Module:
    """A tiny random BertForSequenceClassification or XLMRobertaForSequenceClassification (a
    cross-encoder with one label); returns transformers' model (float32, eval)."""
    from transformers import (BertConfig, BertForSequenceClassification, XLMRobertaConfig,
                              XLMRobertaForSequenceClassification)

    vocab = write_wordpiece_tokenizer(folder, corpus, second_segment=1 if kind == "bert" else 0)
    torch.manual_seed(seed)
    labels = {"num_labels": num_labels, **config_extra}
    if kind == "bert":
        model = BertForSequenceClassification(BertConfig(vocab_size=vocab, max_position_embeddings=128,
                                                         type_vocab_size=2, pad_token_id=0, **ENCODER, **labels))
    else:
        model = XLMRobertaForSequenceClassification(XLMRobertaConfig(
            vocab_size=vocab, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1, **ENCODER, **labels))
    model.eval()
    with torch.no_grad():  # token types apart, so that a pair's segments matter
        g = torch.Generator().manual_seed(seed + 5)
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith(".bias") or "token_type" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
            if "classifier" in name or "pooler" in name:
                p.mul_(20.0)  # logits of order 1, not 0.1: differences show
    model.save_pretrained(folder)
    return model


MODERNBERT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=512, local_attention=16, global_attn_every_n_layers=3,
                  pad_token_id=0, cls_token_id=2, bos_token_id=2, sep_token_id=3, eos_token_id=3)


def make_modernbert(folder: Path, corpus: list[str], pooling: str | None = None, normalize: bool = True,
                    num_labels: int | None = None, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random ModernBertModel saved bare (an embedder; with `pooling`, sentence-
    transformers' files) or, given `num_labels`, a ModernBertForSequenceClassification. Its
    local layers see 8 tokens on each side, so prompts longer than 17 tokens test the window.
    Returns transformers' model (float32, eval)."""
    from transformers import ModernBertConfig, ModernBertForSequenceClassification, ModernBertModel

    vocab = write_wordpiece_tokenizer(folder, corpus)
    torch.manual_seed(seed)
    config = ModernBertConfig(vocab_size=vocab, **{**MODERNBERT, **overrides})
    if num_labels is None:
        model = ModernBertModel(config)
    else:
        config.num_labels = num_labels
        model = ModernBertForSequenceClassification(config)
    # logits of order 1, not 0.1, so differences show; peaked attention, so which keys a token sees shows
    nudge_norms_and_biases(model.eval(), seed, "norm", {"classifier": 20.0, ".attn.": 4.0})
    model.save_pretrained(folder)
    if pooling is not None:
        write_sentence_transformers(folder, pooling, normalize)
    return model


def make_rotary_encoder(folder: Path, family: str, corpus: list[str], pooling: str | None = None,
                        normalize: bool = True, num_labels: int | None = None, seed: int = 0,
                        **overrides) -> torch.nn.Module:
    """A tiny random NomicBertModel or GteModel ("nomic", "gte"; saved as transformers saves
    them: in the families' own tensor names), or with `num_labels` its
    *ForSequenceClassification. Returns transformers' model (float32, eval)."""
    import transformers

    vocab = write_wordpiece_tokenizer(folder, corpus)
    name = {"nomic": "NomicBert", "gte": "Gte"}[family]
    config = getattr(transformers, f"{name}Config")(
        vocab_size=vocab, max_position_embeddings=256, pad_token_id=0,
        **{**ENCODER, "type_vocab_size": 2, "hidden_act": "silu" if family == "nomic" else "gelu", **overrides})
    torch.manual_seed(seed)
    if num_labels is None:
        model = getattr(transformers, f"{name}Model")(config)
    else:
        config.num_labels = num_labels
        model = getattr(transformers, f"{name}ForSequenceClassification")(config)
    # peaked attention and logits of order 1, so that differences show
    nudge_norms_and_biases(model.eval(), seed, "LayerNorm", {"self_attn": 3.0, "classifier": 20.0, "pooler": 5.0})
    model.save_pretrained(folder)
    if pooling is not None:
        write_sentence_transformers(folder, pooling, normalize)
    return model
