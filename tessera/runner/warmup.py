"""Warm-up: run the largest step the config allows, measure what it needed, and give the KV
cache a fraction of the memory that remains (TGI's warmup, vLLM's memory profiling)."""
from __future__ import annotations

import gc
import logging
import resource
from dataclasses import dataclass
from typing import Callable

import psutil
import torch

from tessera.config import ConfigError, EngineConfig
from tessera.ops.attention import AttentionMetadata
from tessera.platform import available_memory_bytes
from tessera.runner.inputs import ModelInputs
from tessera.runner.model_runner import PROMPT_LOGIT_ROWS, ModelRunner
from tessera.sampling.params import SamplingParams
from tessera.sampling.sampler import SamplingBatch

logger = logging.getLogger(__name__)


@dataclass
class DraftSizing:
    """A speculative draft model, as the KV cache plan sees it."""

    runner: ModelRunner
    max_model_len: int  # its own context: its passes never go beyond it


@dataclass
class KVCachePlan:
    num_blocks: int
    activation_bytes: int
    available_bytes: int
    bytes_per_block: int


def _blocks_for(lengths: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in lengths)


def _split(num_tokens: int, max_seq_len: int | None) -> list[int]:
    """A step of `num_tokens` prompt tokens as sequences of at most `max_seq_len` each."""
    size = num_tokens if max_seq_len is None else max_seq_len
    return [min(size, num_tokens - start) for start in range(0, num_tokens, size)]


def _dummy_inputs(lengths: list[int], num_logit_rows: int, block_size: int, device: torch.device) -> ModelInputs:
    """Prompts of `lengths` tokens, each in its own consecutive blocks, logits for the last rows."""
    slots, tables, positions = [], [], []
    first_block = 0
    width = max(-(-n // block_size) for n in lengths)
    for n in lengths:
        blocks = -(-n // block_size)
        slots.append(torch.arange(n) + first_block * block_size)
        table = list(range(first_block, first_block + blocks))
        tables.append(table + [0] * (width - blocks))
        positions.append(torch.arange(n))
        first_block += blocks
    num_tokens = sum(lengths)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    attn = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        num_decodes=0, num_decode_tokens=0, seq_lens_list=list(lengths), query_lens_list=list(lengths))
    return ModelInputs(
        input_ids=torch.zeros(num_tokens, dtype=torch.long, device=device),
        positions=torch.cat(positions).to(device), attn=attn,
        lm_head_indices=torch.arange(num_tokens - num_logit_rows, num_tokens, device=device),
        sampled_rows=[], max_block_id=first_block - 1)


def profile_peak_step(runner: ModelRunner, num_tokens: int, num_logit_rows: int,
                      max_seq_len: int | None = None) -> int:
    """Run the largest step once with a scratch cache; returns the bytes it needed beyond
    what was resident before (an upper bound on CPU, exact on CUDA). `max_seq_len`: the
    step's tokens as several prompts of at most this many (a step holds several sequences;
    none is longer than max_model_len)."""
    device = runner.device
    lengths = _split(num_tokens, max_seq_len)
    runner.allocate_kv_cache(_blocks_for(lengths, runner.block_size))
    inputs = _dummy_inputs(lengths, min(num_logit_rows, num_tokens), runner.block_size, device)
    if runner.state_layers:  # each prompt in a slot of its own (at most max_num_seqs of them), from zero
        attn = inputs.attn
        attn.state_slots_list, attn.state_fresh_list = list(range(len(lengths))), [True] * len(lengths)
        attn.state_slots = torch.arange(len(lengths), device=device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _run_step(runner, inputs)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        _reset_peak_rss()
        rss_before = psutil.Process().memory_info().rss
        _run_step(runner, inputs)
        max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        peak = max(max_rss - rss_before, 0)
    runner.release_kv_cache()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return int(peak)


def profile_image_encoder(runner: ModelRunner, image_inputs: dict[str, torch.Tensor]) -> int:
    """The bytes the vision encoder needs beyond what is resident, for one image (the
    largest the model's processor makes)."""
    device = runner.device
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        runner.model.encode_images(image_inputs)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        torch.cuda.empty_cache()
    else:
        _reset_peak_rss()
        rss_before = psutil.Process().memory_info().rss
        runner.model.encode_images(image_inputs)
        peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before, 0)
    logger.info("warm-up: encoding the largest image needed %.1f MiB", peak / 2**20)
    return int(peak)


def _reset_peak_rss() -> None:
    """Start the process's peak RSS over from what is resident now (Linux: clear_refs 5),
    so a second engine in one process (a notebook, a benchmark comparing two) is not
    charged the first one's peak. Elsewhere the peak covers the process's life: the budget
    is smaller, never too big."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _run_step(runner: ModelRunner, inputs: ModelInputs) -> None:
    """The forward passes, and the sampler over the first pass's rows with every processor
    on (it holds several rows x vocabulary copies: as much as the logits themselves). An
    embedding model's step computes no logits."""
    if runner.pooler is not None:
        runner.forward_no_logits(inputs)
        return
    for index, logits in enumerate(runner.forward(inputs)):
        if index == 0 and runner.sampler is not None:
            rows = logits.shape[0]
            # throwaway generators: the engine's own must not depend on the warm-up's shape
            batch = SamplingBatch(params=[WORST_CASE_SAMPLING] * rows,
                                  generators=[torch.Generator() for _ in range(rows)],
                                  token_ids=[[0]] * rows, num_prompt_tokens=[1] * rows)
            runner.sampler.sample(logits, batch).logprobs  # noqa: B018 (computes them)
        del logits


# every processor and logprobs: the sampler's largest footprint per row
WORST_CASE_SAMPLING = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, typical_p=0.9,
                                     repetition_penalty=1.1, frequency_penalty=0.1, logprobs=20,
                                     watermark=True)


def plan_kv_cache(runner: ModelRunner, *, memory_fraction: float, max_num_batched_tokens: int,
                  max_num_seqs: int, max_model_len: int, max_sampled_rows: int | None = None,
                  draft: DraftSizing | None = None,
                  largest_image: Callable[[], dict[str, torch.Tensor]] | None = None,
                  overrun_tokens: int = 0) -> KVCachePlan:
    """`max_sampled_rows`: the most rows a step samples (default max_num_seqs; more with
    speculative decoding, which samples after every draft). `draft`: a draft model, whose
    cache has as many blocks (a block costs both models' bytes) and whose passes (at most
    a step's tokens within its own context, a row per sequence) run between the target's.
    `largest_image`: a multimodal model's encoder inputs for its largest image.
    `overrun_tokens`: how far past the budget a step may go (an image whose tokens attend
    to each other, taken whole: scheduler.py)."""
    # a step's tokens over as many sequences as it may hold, none past max_model_len
    num_tokens = min(max_num_batched_tokens + overrun_tokens, max_num_seqs * max_model_len)
    # the LM head's largest pass: every row sampling, or one pass of prompt-logprob rows
    activation = profile_peak_step(runner, num_tokens, max(max_sampled_rows or max_num_seqs, PROMPT_LOGIT_ROWS),
                                   max_seq_len=max_model_len)
    if largest_image is not None and runner.device.type == "cuda":
        # a step may encode an image before its forward; not measured on a CPU, where the
        # cache takes a fifth of RAM and encoding Qwen's largest image (16k patches) would
        # take minutes of every start
        activation = max(activation, profile_image_encoder(runner, largest_image()))
    if draft is not None:
        activation = max(activation, profile_peak_step(
            draft.runner, num_tokens, max_num_seqs, max_seq_len=min(max_model_len, draft.max_model_len)))
    available = available_memory_bytes(str(runner.device))
    per_block = runner.kv_bytes_per_block() * runner.ranks_sharing_memory
    if draft is not None:
        per_block += draft.runner.kv_bytes_per_block()
    # the fraction of what a step's activations leave: a model that fills most of a host's
    # RAM still gets a cache (a fraction of all that is available, less the activations,
    # left none for a 30B mixture of experts in int4 on 24 GB)
    left = available - activation * runner.ranks_sharing_memory
    num_blocks = max(int(left * memory_fraction) // per_block, 0)
    num_blocks = min(num_blocks, useful_blocks(max_num_seqs, max_model_len, runner.block_size))
    logger.info("warm-up: peak step of %d tokens needed %.1f MiB; %.1f GiB available, "
                "%.0f%% of what that leaves for the KV cache", num_tokens, activation / 2**20,
                available / 2**30, memory_fraction * 100)
    return KVCachePlan(num_blocks, activation, available, per_block)


def useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The most blocks sizing gives: more than every sequence at full length could use is
    memory held for nothing."""
    return max_num_seqs * -(-max_model_len // block_size)


def max_decode_rows(config: EngineConfig) -> int:
    """The most rows a decode step can have, each sampled: one per sequence, and one
    per verified draft with speculative decoding (while at most disable_by_batch_size
    sequences run, within the step's token budget). Warm-up profiles the LM head and
    sampler for this many rows; decode graphs cover it."""
    sched, spec = config.scheduler, config.speculative
    speculating = min(sched.max_num_seqs, spec.disable_by_batch_size or sched.max_num_seqs)
    rows = max(sched.max_num_seqs, speculating * (1 + spec.num_speculative_tokens))
    return min(rows, max(sched.max_num_batched_tokens, sched.max_num_seqs))


def size_kv_cache(runner: ModelRunner, config: EngineConfig, max_model_len: int,
                  draft: DraftSizing | None = None,
                  largest_image: Callable[[], dict[str, torch.Tensor]] | None = None,
                  overrun_tokens: int = 0) -> tuple[int, int]:
    """(KV blocks, max_model_len): the configured block count or warm-up's plan; a cache
    that cannot hold max_model_len tokens clamps it. `draft`: a speculative draft model
    (its cache gets as many blocks); `largest_image`, `overrun_tokens`: plan_kv_cache's."""
    cache, sched = config.cache, config.scheduler
    num_blocks = cache.num_blocks
    if num_blocks is None:
        plan = plan_kv_cache(runner, memory_fraction=cache.fraction_for(config.device),
                             max_num_batched_tokens=sched.max_num_batched_tokens,
                             max_num_seqs=sched.max_num_seqs, max_model_len=max_model_len,
                             max_sampled_rows=max_decode_rows(config), draft=draft,
                             largest_image=largest_image, overrun_tokens=overrun_tokens)
        num_blocks = plan.num_blocks
    capacity = num_blocks * cache.block_size
    if capacity < cache.block_size:
        raise ConfigError("not enough memory for even one KV cache block; "
                          "free memory or raise memory_fraction")
    if capacity < max_model_len:
        logger.warning("KV cache holds %d tokens, less than max_model_len %d: "
                       "clamping max_model_len to %d", capacity, max_model_len, capacity)
        max_model_len = capacity
    per_token = (runner.kv_bytes_per_block() + (draft.runner.kv_bytes_per_block() if draft else 0)) / cache.block_size
    logger.info("KV cache: %d blocks of %d tokens = %d tokens (%s, %.1f MiB, %.0f KiB per token%s); "
                "max_model_len %d", num_blocks, cache.block_size, capacity,
                str(runner.kv_cache_dtype).removeprefix("torch."),
                num_blocks * per_token * cache.block_size / 2**20, per_token / 1024,
                ", the draft model's included" if draft else "", max_model_len)
    return num_blocks, max_model_len
