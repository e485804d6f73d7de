"""Scoring text pairs (vLLM's LLM.score, /score, /rerank). With an embedding model each text
is embedded once and a pair's score is the cosine similarity of its two vectors; with a
cross-encoder (a one-label sequence classifier) the pair is one prompt, the two texts
encoded together as its tokenizer encodes a pair, and its score is the classifier's logit
through the model's activation (sigmoid unless the checkpoint says otherwise)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessera.pooling.config import PoolerConfig
from tessera.pooling.params import TokenTypedPrompt


class PairingError(ValueError):
    pass


def pair_indices(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """Which texts are scored together, as vLLM pairs them: one with one, one with each of
    many, or many with as many, position by position."""
    if num_first == 0 or num_second == 0:
        raise PairingError("both sides of a score need at least one text")
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first != num_second:
        raise PairingError(f"{num_first} first texts and {num_second} second texts: give one first text, "
                           "or as many as second texts")
    return [(i, i) for i in range(num_first)]


def cosine_scores(first: list[torch.Tensor], second: list[torch.Tensor],
                  pairs: list[tuple[int, int]]) -> list[float]:
    a = torch.stack([first[i] for i, _ in pairs]).float()
    b = torch.stack([second[j] for _, j in pairs]).float()
    return F.cosine_similarity(a, b, dim=-1).tolist()


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score (vLLM's shape: `output.outputs.score`)."""

    request_id: str
    prompt_token_ids: list[int]  # the two texts' tokens, one after the other
    outputs: ScoringOutput
    finished: bool = True


def encode_pair(tokenizer, first: str, second: str, max_length: int | None = None,
                segments: bool = True, template: str | None = None) -> TokenTypedPrompt | list[int]:
    """A cross-encoder's prompt: the pair as its tokenizer encodes one (BERT: [CLS] a [SEP] b
    [SEP], segments 0 then 1; a decoder's tokenizer: the two texts' tokens one after the
    other, no segments). `max_length`: cut the longer text to fit, a token at a time.
    `template`: a chat template that writes the pair itself (vLLM's score template: the
    messages [{"role": "query", ...}, {"role": "document", ...}], Qwen3-Reranker's
    instruction around them); no segments, and a prompt too long is refused."""
    if not isinstance(first, str) or not isinstance(second, str):
        raise PairingError("a cross-encoder scores texts, not token ids")
    if template is not None:
        return _templated_pair(tokenizer, first, second, max_length, template)
    cut = {}
    if max_length is not None:
        specials = tokenizer.num_special_tokens_to_add(pair=True)
        if max_length < specials + 2:
            raise PairingError(f"truncating a pair to {max_length} tokens leaves no room for its texts beside "
                               f"the tokenizer's {specials} special tokens")
        cut = {"truncation": "longest_first", "max_length": max_length}  # vLLM's: the longer text first
    try:
        encoded = tokenizer(first, second, return_token_type_ids=segments, **cut)
    except Exception as exc:  # the tokenizer's own refusal (a text it cannot cut to fit)
        raise PairingError(f"the pair cannot be tokenized to fit: {exc}") from exc
    if not segments:
        return list(encoded.input_ids)
    return TokenTypedPrompt(list(encoded.input_ids), list(encoded.token_type_ids))


def _templated_pair(tokenizer, first: str, second: str, max_length: int | None, template: str) -> list[int]:
    messages = [{"role": "query", "content": first}, {"role": "document", "content": second}]
    try:
        text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    except Exception as exc:  # the template's own complaint names what it disliked
        raise PairingError(f"the score template cannot render the pair: {exc}") from exc
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)  # the template writes its own markers
    if max_length is not None and len(ids) > max_length:
        raise PairingError(f"the pair in the score template is {len(ids)} tokens, over the limit of {max_length}")
    return ids


def cross_encoder_score(logits: torch.Tensor, config: PoolerConfig) -> float:
    """A one-label classifier's relevance score from its logits."""
    logit = logits[0]
    return float(torch.sigmoid(logit) if config.score_activation == "sigmoid" else logit)


def require_one_label(config: PoolerConfig) -> None:
    if len(config.labels) != 1:
        raise PairingError(f"scores come from a one-label cross-encoder; this classifier has {len(config.labels)} "
                           "labels (classify its inputs instead)")


def label_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """A classifier's probabilities: softmax over its labels, the sigmoid of a lone label's
    logit (a softmax over one label is always 1)."""
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, -1)


def cross_encoder_prompts(tokenizer, first: list, second: list, pairs: list[tuple[int, int]],
                          config: PoolerConfig, max_length: int) -> list[TokenTypedPrompt | list[int]]:
    """A one-label cross-encoder's prompt for each pair (encode_pair's, cut to `max_length`)."""
    require_one_label(config)
    return [encode_pair(tokenizer, first[i], second[j], max_length, config.pair_segments, config.pair_template)
            for i, j in pairs]
