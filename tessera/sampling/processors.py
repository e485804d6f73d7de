"""Logits processors as vectorised functions over a [B, V] float tensor.

Each takes per-row parameters as tensors and leaves the rows whose parameter is neutral
exactly unchanged (a row with top_p=1 keeps its whole tail even where float rounding of a
cumulative sum would say otherwise). None of them loops over rows or the vocabulary in
Python. Formulas follow Hugging Face transformers' processors of the same name, which the
tests check them against; the order the sampler applies them in is theirs too.
"""
from __future__ import annotations

import torch

from tessera.platform import to_device

NEG_INF = float("-inf")


def device_tensor(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host list on the device without waiting for it (torch.tensor(..., device=cuda)
    synchronises with the stream, which would stall async scheduling)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] float32: how often each token occurs in each row's list (a scatter-add of one
    flat index tensor, not a loop over rows). Ids >= vocab_size are ignored."""
    counts = torch.zeros(len(token_ids), vocab_size + 1, dtype=torch.float32)
    lengths = torch.tensor([len(ids) for ids in token_ids])
    if int(lengths.sum()):
        flat = torch.tensor([t for ids in token_ids for t in ids]).clamp_(max=vocab_size)
        rows = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
        counts.index_put_((rows, flat), torch.ones(flat.numel()), accumulate=True)
    return to_device(counts[:, :vocab_size], device)  # on CPU: the view, no copy


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """HF / TGI: for tokens already in the prompt or output (`seen`, bool [B, V]), a
    positive logit is divided by the penalty and a negative one multiplied by it."""
    penalty = penalty.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen & (penalty != 1.0), penalised, logits)


def apply_frequency_presence_penalties(logits: torch.Tensor, output_counts: torch.Tensor,
                                       frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """OpenAI: logit -= frequency * count + presence * (count > 0), over output tokens."""
    return (logits - frequency.unsqueeze(1) * output_counts
            - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype))


def apply_logit_bias(logits: torch.Tensor, rows: list[int], token_ids: list[int],
                     bias: list[float]) -> torch.Tensor:
    """Add `bias[i]` to logits[rows[i], token_ids[i]] (ids beyond the vocabulary ignored)."""
    vocab = logits.shape[1]
    keep = [i for i, t in enumerate(token_ids) if t < vocab]
    if not keep:
        return logits
    device = logits.device
    index = (device_tensor([rows[i] for i in keep], device),
             device_tensor([token_ids[i] for i in keep], device))
    values = device_tensor([bias[i] for i in keep], device, logits.dtype)
    return logits.index_put(index, values, accumulate=True)


def suppress_tokens(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> torch.Tensor:
    """Set logits[rows[i], token_ids[i]] to -inf (min_tokens: EOS and stop token ids)."""
    vocab = logits.shape[1]
    keep = [i for i, t in enumerate(token_ids) if t < vocab]
    if not keep:
        return logits
    device = logits.device
    index = (device_tensor([rows[i] for i in keep], device),
             device_tensor([token_ids[i] for i in keep], device))
    return logits.index_put(index, torch.full((), NEG_INF, dtype=logits.dtype, device=device))


def force_tokens(logits: torch.Tensor, rows: list[int], ids: list[int]) -> torch.Tensor:
    """Row rows[k] certain to take ids[k]: its logits -inf but that one's, 0 (a probability
    of 1 whatever masked or biased it before)."""
    device = logits.device
    out = logits.clone()
    index = device_tensor(rows, device)
    out[index] = NEG_INF
    out[index, device_tensor(ids, device)] = 0.0
    return out


def allow_only(logits: torch.Tensor, allowed: dict[int, list[int]]) -> torch.Tensor:
    """Every logit of row r at -inf but those of allowed[r] (vLLM's allowed_token_ids)."""
    vocab, device = logits.shape[1], logits.device
    rows = list(allowed)
    keep = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for k, r in enumerate(rows):
        keep[k, [t for t in allowed[r] if t < vocab]] = True
    out = logits.clone()
    index = device_tensor(rows, device)
    out[index] = logits[index].masked_fill(~to_device(keep, device), NEG_INF)
    return out


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits / temperature.unsqueeze(1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k best logits of each row (ties with the k-th kept, as in HF); k <= 0 or
    k >= V keeps everything."""
    k_max = min(int(top_k.max()), logits.shape[-1])
    if k_max <= 0:
        return logits
    kth = logits.topk(k_max, dim=-1).values  # [B, k_max], descending
    k = torch.where(top_k > 0, top_k, k_max).clamp(max=k_max)
    threshold = kth.gather(1, (k - 1).unsqueeze(1))
    keep = (logits >= threshold) | (top_k <= 0).unsqueeze(1)
    return logits.masked_fill(~keep, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, prefix: int | None = 256) -> torch.Tensor:
    """Nucleus: keep the smallest set of best tokens whose probability reaches top_p (a
    token is dropped when the tokens better than it already hold top_p); the best token
    always stays.

    A full sort of the vocabulary is the expensive part on CPU (260 ms for 64 x 49k), so
    only the best `prefix` tokens are sorted (with topk); every token beyond a prefix that
    already holds top_p is dropped anyway, so the result is the full sort's. Only when
    some row's nucleus reaches past the prefix (a flat distribution) is everything sorted.
    That check waits for the device; `prefix=None` sorts everything at once instead (a GPU
    sorts fast, and must not wait under async scheduling)."""
    active = top_p < 1.0
    probs = logits.softmax(dim=-1)
    vocab = logits.shape[-1]
    sizes = (vocab,) if prefix is None or prefix >= vocab else (prefix, vocab)
    for k in sizes:
        top_ids = logits.topk(k, dim=-1).indices  # sorted, best first
        top_probs = probs.gather(1, top_ids)
        cumulative = top_probs.cumsum(dim=-1)
        if k == vocab or bool(((cumulative[:, -1] >= top_p) | ~active).all()):
            break
    mass_before = cumulative - top_probs
    keep_sorted = mass_before < top_p.unsqueeze(1)
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top_ids, keep_sorted)
    return logits.masked_fill(~(keep | (~active).unsqueeze(1)), NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the best token's (HF MinP)."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    drop = (probs < threshold) & (min_p > 0).unsqueeze(1)
    return logits.masked_fill(drop, NEG_INF)


def apply_typical_p(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al.; HF TypicalLogitsWarper): rank tokens by
    how far their surprisal is from the entropy and keep the closest ones until their
    probability reaches `mass`."""
    log_probs = logits.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum(dim=-1, keepdim=True)
    distance = (-log_probs - entropy).abs()
    sorted_distance, order = distance.sort(dim=-1)
    cumulative = logits.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass.unsqueeze(1)).sum(dim=1).clamp(max=logits.shape[-1] - 1)
    drop_sorted = sorted_distance > sorted_distance.gather(1, last.unsqueeze(1))
    drop_sorted[:, 0] = False
    drop_sorted &= (mass < 1.0).unsqueeze(1)
    drop = drop_sorted.scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)
