"""Runs one scheduled step: builds inputs, runs the model, computes logits only where a
token is sampled (or prompt logprobs are wanted), and samples. Owns the KV cache tensors
and binds them to the model's attention layers."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tessera.engine.scheduler import ScheduledSeq
from tessera.ops.attention import Attention, attention_context
from tessera.runner.inputs import ModelInputs, PromptRows, build_inputs
from tessera.sampling.sampler import Sampler, SamplingBatch, TokenLogprobs, prompt_logprobs


@dataclass
class SampledToken:
    item: ScheduledSeq
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass
class StepResult:
    samples: list[SampledToken] = field(default_factory=list)
    # per sequence asking for prompt logprobs: its rows and their logprobs, in position order
    prompt_logprobs: list[tuple[PromptRows, list[TokenLogprobs]]] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, device: torch.device,
                 dtype: torch.dtype, sampler: Sampler):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.sampler = sampler
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        if not self.attn_layers:
            raise ValueError(f"{type(model).__name__} has no Attention layers to give a KV cache")
        self.num_blocks = 0

    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_token = sum(2 * a.num_kv_heads * a.head_size for a in self.attn_layers)
        return per_token * self.block_size * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_size].

        Allocated uninitialised and zeroed block by block on first use: zeroing gigabytes
        up front costs seconds of start-up and commits memory nothing may ever use, but a
        never-written slot inside a gathered block must not hold NaN garbage (attention
        masks it, and 0 * NaN is still NaN).
        """
        self.release_kv_cache()
        for layer in self.attn_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            layer.kv_cache = (torch.empty(shape, dtype=self.dtype, device=self.device),
                              torch.empty(shape, dtype=self.dtype, device=self.device))
        self.num_blocks = num_blocks
        self._zeroed_blocks = 0

    def _zero_blocks_up_to(self, end: int) -> None:
        if end <= self._zeroed_blocks:
            return
        for layer in self.attn_layers:
            for cache in layer.kv_cache:
                cache[self._zeroed_blocks:end].zero_()
        self._zeroed_blocks = end

    def release_kv_cache(self) -> None:
        for layer in self.attn_layers:
            layer.kv_cache = None
        self.num_blocks = 0

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        """Logits [S, vocab] (float32) for the rows in `inputs.lm_head_indices`."""
        self._zero_blocks_up_to(inputs.max_block_id + 1)
        with attention_context(inputs.attn):
            hidden = self.model(inputs.input_ids, inputs.positions)
        return self.model.compute_logits(hidden.index_select(0, inputs.lm_head_indices))

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepResult:
        """Run one step: the sampled token (and its logprobs) of each sequence that samples,
        and the prompt logprobs this step computed."""
        inputs = build_inputs(scheduled, self.block_size, self.device)
        if not inputs.sampled_rows and not inputs.prompt_rows:  # only partial prefill chunks
            self._zero_blocks_up_to(inputs.max_block_id + 1)
            with attention_context(inputs.attn):
                self.model(inputs.input_ids, inputs.positions)
            return StepResult()
        logits = self.forward(inputs)
        rows = inputs.sampled_rows
        result = StepResult()
        if rows:
            seqs = [s.seq for s in rows]
            batch = SamplingBatch(params=[s.params for s in seqs],
                                  generators=[s.generator for s in seqs],
                                  token_ids=[s.token_ids for s in seqs],
                                  num_prompt_tokens=[s.num_prompt_tokens for s in seqs])
            out = self.sampler.sample(logits[:len(rows)], batch)
            result.samples = [SampledToken(item, token, lp) for item, token, lp
                              in zip(rows, out.token_ids.tolist(), out.logprobs)]
        if inputs.prompt_rows:
            targets = [t for r in inputs.prompt_rows for t in r.next_token_ids]
            num_top = [r.item.seq.params.prompt_logprobs for r in inputs.prompt_rows
                       for _ in range(r.count)]
            info = prompt_logprobs(logits[len(rows):],
                                   torch.tensor(targets, device=logits.device), num_top)
            offset = 0
            for r in inputs.prompt_rows:
                result.prompt_logprobs.append((r, info[offset:offset + r.count]))
                offset += r.count
        return result
