"""`tessera bench embed`: embedding throughput, beside transformers in the same process.

--num-prompts prompts of --input-len random tokens (or --dataset's texts) are embedded by the
engine (its prefix cache reset before each run, so every prompt is computed), and with
`--baseline transformers` by transformers' backbone the way sentence-transformers runs it:
prompts sorted by length, padded batches of --embed-batch-size, pooled as the engine's
pooler config says. With real weights the baseline row reports the least cosine similarity
between its vectors and tessera's (bf16 gives > 0.99, float32 1.0); with --load-format dummy
(presets) the two engines' random weights differ and nothing is compared."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessera.bench.workload import median
from tessera.pooling.config import PoolerConfig


@dataclass
class EmbedBenchResult:
    engine: str
    prompts_per_s: float
    tokens_per_s: float
    elapsed_s: float
    padded_batch: int | None = None   # the baseline's batch of padded prompts
    min_cosine: float | None = None   # baseline vs tessera, over every prompt (embeddings)
    max_logit_diff: float | None = None  # baseline vs tessera (classifiers)


def tessera_embed(llm, prompts: list[list[int]], repeats: int) -> tuple[EmbedBenchResult, torch.Tensor]:
    """Embeddings, or a classifier's label logits (each prompt one input of the classifier)."""
    classify = llm.engine.pooler_config.task == "classify"

    def run(batch: list[list[int]]):
        # a classifier's raw logits (LLM.classify returns their softmax: all 1.0 for one label)
        return llm._pool(batch, None, False, None, None, "Classifying") if classify else llm.embed(batch, use_tqdm=False)

    run(prompts[:1])  # warm
    times, vectors = [], None
    for _ in range(repeats):
        llm.reset_prefix_cache()
        started = time.perf_counter()
        outs = run(prompts)
        times.append(time.perf_counter() - started)
        vectors = torch.stack([o.outputs.data for o in outs])
    elapsed = median(times)
    return EmbedBenchResult("tessera", len(prompts) / elapsed, sum(map(len, prompts)) / elapsed, elapsed), vectors


def load_transformers_backbone(path: str, dtype: torch.dtype, dummy: bool, device: torch.device,
                               classifier: bool = False):
    """transformers' AutoModel (or AutoModelForSequenceClassification) of the folder."""
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if classifier else AutoModel
    if dummy:
        with torch.device(device):
            return auto.from_config(AutoConfig.from_pretrained(path), dtype=dtype).eval()
    return auto.from_pretrained(path, dtype=dtype).to(device).eval()


def _pool(hidden: torch.Tensor, lengths: torch.Tensor, config: PoolerConfig) -> torch.Tensor:
    """Right-padded [B, T, H] hidden states pooled per row (float32)."""
    hidden = hidden.float()
    if config.pooling_type == "LAST":
        vectors = hidden[torch.arange(hidden.shape[0]), lengths - 1]
    elif config.pooling_type == "CLS":
        vectors = hidden[:, 0]
    else:
        mask = (torch.arange(hidden.shape[1], device=hidden.device)[None, :] < lengths[:, None]).float()
        vectors = (hidden * mask[..., None]).sum(1) / lengths[:, None]
    return F.normalize(vectors, dim=-1) if config.normalize else vectors


def _embed_batches(model, prompts: list[list[int]], config: PoolerConfig, batch_size: int) -> torch.Tensor:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    width = len(config.labels) if config.task == "classify" else model.config.hidden_size
    out = torch.empty(len(prompts), width)
    device = model.device
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            width = max(len(prompts[i]) for i in rows)
            ids = torch.tensor([prompts[i] + [0] * (width - len(prompts[i])) for i in rows], device=device)
            lengths = torch.tensor([len(prompts[i]) for i in rows], device=device)
            mask = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
            result = model(input_ids=ids, attention_mask=mask)
            out[rows] = (result.logits.float() if config.task == "classify"
                         else _pool(result.last_hidden_state, lengths, config)).cpu()
    return out


def transformers_embed(model, prompts: list[list[int]], config: PoolerConfig, batch_size: int, repeats: int,
                       reference: torch.Tensor | None) -> EmbedBenchResult:
    """`reference`: tessera's vectors of the same weights (None: random weights, which the
    two engines draw differently)."""
    _embed_batches(model, prompts[:1], config, 1)  # warm
    times, vectors = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        vectors = _embed_batches(model, prompts, config, batch_size)
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        times.append(time.perf_counter() - started)
    elapsed = median(times)
    result = EmbedBenchResult("transformers", len(prompts) / elapsed, sum(map(len, prompts)) / elapsed, elapsed,
                              batch_size)
    if reference is not None and config.task == "classify":
        result.max_logit_diff = (vectors - reference.to(vectors.dtype)).abs().max().item()
    elif reference is not None:
        result.min_cosine = F.cosine_similarity(vectors, reference.to(vectors.dtype), dim=-1).min().item()
    return result
