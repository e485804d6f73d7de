"""Runs one scheduled step: builds inputs, runs the model, computes logits only where a
token is sampled (or prompt logprobs are wanted), and samples. Owns the KV cache tensors
and binds them to the model's attention layers, and the recurrent layers' state slots."""
from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from tessera.config import ConfigError
from tessera.distributed.channel import Command, StepChannel
from tessera.engine.scheduler import ScheduledSeq
from tessera.lora.adapter import LoRAAdapter
from tessera.lora.layer import LoRAPass, lora_context
from tessera.lora.slots import LoRASlots
from tessera.multimodal.encoder_cache import EncoderCache
from tessera.ops.attention import Attention, attention_context
from tessera.ops.linear_attention import RecurrentLayer
from tessera.pooling.model import classify_rows
from tessera.pooling.pooler import Pooler
from tessera.runner.cuda_graphs import CudaDecodeGraphs
from tessera.runner.decode_graphs import CpuDecodeGraphs
from tessera.runner.graph_inputs import GraphLimits
from tessera.runner.huge_pages import empty_huge_like, move_weights_to_huge_pages
from tessera.runner.inputs import ModelInputs, PromptRows, build_inputs
from tessera.runner.launched_step import LaunchedStep, StepResult
from tessera.sampling.sampler import Sampler, SamplerOutput, SamplingBatch, TokenLogprobs, prompt_logprobs


# Prompt-logprob positions whose logits exist at once: an 8192-token prompt chunk of a
# 128k-vocabulary model would otherwise hold 4 GiB of float32 logits, memory warm-up never
# measured (it sizes the KV cache for max_num_seqs sampled rows).
PROMPT_LOGIT_ROWS = 128


class ModelRunner:
    """On the driver, `channel` (tensor parallelism) mirrors every cache and forward call
    to the other ranks before running it here; the other ranks run the same methods on
    what they receive (tessera/distributed/worker.py) and have no sampler."""

    def __init__(self, model: nn.Module, block_size: int, device: torch.device,
                 dtype: torch.dtype, sampler: Sampler | None,
                 channel: StepChannel | None = None, ranks_sharing_memory: int = 1,
                 decode_graphs: bool = False, pooler: Pooler | None = None, num_state_slots: int = 0):
        """`num_state_slots`: how many sequences' states the model's recurrent layers keep
        (max_num_seqs); allocated here, before warm-up measures the memory left."""
        self.model = model
        self.pooler = pooler  # an embedding model's: pools hidden states, samples nothing
        self.channel = channel
        # ranks whose KV caches come out of the same memory as this one's (CPU ranks on one
        # host); the cache planner divides what it finds among them
        self.ranks_sharing_memory = ranks_sharing_memory
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.sampler = sampler
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        if not self.attn_layers:
            raise ValueError(f"{type(model).__name__} has no Attention layers to give a KV cache")
        # what the cache stores: the model dtype or 8-bit floats (the target the model was built for)
        self.kv_cache_dtype = self.attn_layers[0].cache_dtype
        self.num_blocks = 0
        self.state_layers = [m for m in model.modules() if isinstance(m, RecurrentLayer)]
        # CPU kernel graphs replay a recurrent model's steps with the slots as an input
        # buffer, padded rows on one spare slot; CUDA graphs of them are not written yet
        state_graphs = decode_graphs and device.type == "cpu"
        if self.state_layers:
            self._allocate_state(num_state_slots, spare=state_graphs)
        if device.type == "cpu":  # decode streams every weight once: fewer TLB misses pay
            move_weights_to_huge_pages(model)
        # decode steps replayed from captured graphs (one rank): kernel graphs on CPU, CUDA
        # graphs on GPU; they cover steps within `graph_limits` (the engine sets them before
        # allocating the cache; without them graphs stay off)
        self.graphs: CpuDecodeGraphs | CudaDecodeGraphs | None = None
        if decode_graphs and (state_graphs or not self.state_layers):
            self.graphs = (CudaDecodeGraphs(model, block_size, device) if device.type == "cuda"
                           else CpuDecodeGraphs(model, block_size,
                                                self.num_state_slots if self.state_layers else None))
        self.graph_limits: GraphLimits | None = None
        self.lora: LoRASlots | None = None  # adapter slots, once enable_lora ran
        self.encoder_cache = EncoderCache()  # images seen before, by their pixels' hash

    def enable_lora(self, num_slots: int, max_rank: int) -> None:
        """Give every linear layer adapter slots (before the KV cache is sized: they take
        device memory)."""
        self.lora = LoRASlots(self.model, num_slots, max_rank, self.dtype, self.device)

    def load_lora(self, slot: int, adapter: LoRAAdapter) -> None:
        """Another rank: repeat a load the driver made."""
        self.lora.load(slot, adapter)

    def _allocate_state(self, num_slots: int, spare: bool) -> None:
        """Every recurrent layer's state tensors, [num_slots, *shape], zeroed (a fresh
        sequence never reads its slot, but the memory is committed now, before warm-up
        measures what is left for the KV cache); `spare`: one slot more, number num_slots,
        which no sequence gets (a padded graph step's rows use it)."""
        if num_slots <= 0:
            raise ValueError(f"{type(self.model).__name__} has recurrent layers: it needs state slots")
        per_slot = self.state_bytes_per_sequence()
        try:
            for layer in self.state_layers:
                layer.state = tuple(torch.zeros((num_slots + spare, *shape), dtype=dtype, device=self.device)
                                    for shape, dtype in layer.state_shapes())
        except RuntimeError as exc:  # (torch.OutOfMemoryError among them)
            for layer in self.state_layers:
                layer.state = None
            raise ConfigError(f"the recurrent layers' state for {num_slots} sequences needs "
                              f"{num_slots * per_slot / 2**30:.1f} GiB ({per_slot / 2**20:.1f} MiB a sequence), "
                              f"more than there is: lower --max-num-seqs") from exc
        self.num_state_slots = num_slots

    def state_bytes_per_sequence(self) -> int:
        """What one slot of every recurrent layer's state takes."""
        return sum(layer.state_bytes_per_slot() for layer in self.state_layers)

    def kv_bytes_per_block(self) -> int:
        elem = self.kv_cache_dtype.itemsize
        per_token = sum(a.cache_tensors * a.num_kv_heads * a.head_size for a in self.attn_layers)
        return per_token * self.block_size * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Per layer, K and V of shape [num_blocks, block_size, num_kv_heads, head_size] (one
        tensor bound as both where the layer's values are its keys).

        Allocated uninitialised and zeroed block by block on first use: zeroing gigabytes
        up front costs seconds of start-up and commits memory nothing may ever use, but a
        never-written slot inside a gathered block must not hold NaN garbage (attention
        masks it, and 0 * NaN is still NaN).
        """
        self.release_kv_cache()
        if self.channel is not None:
            self.channel.send(Command.ALLOCATE_KV, num_blocks)
        for layer in self.attn_layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_size)
            keys = self._empty_cache(shape)
            layer.kv_cache = (keys, keys if layer.value_is_key else self._empty_cache(shape))
        self.num_blocks = num_blocks
        self._zeroed_blocks = 0
        if self.graphs is not None:  # the graphs hold the old cache's pointers
            self._zero_blocks_up_to(1)  # padded rows read block 0
            self.graphs.reset(self.graph_limits)

    def _empty_cache(self, shape: tuple[int, ...]) -> torch.Tensor:
        if self.device.type == "cpu":
            return empty_huge_like(shape, self.kv_cache_dtype)
        return torch.empty(shape, dtype=self.kv_cache_dtype, device=self.device)

    def _zero_blocks_up_to(self, end: int) -> None:
        if end <= self._zeroed_blocks:
            return
        for layer in self.attn_layers:
            for cache in layer.kv_cache[:layer.cache_tensors]:  # as bytes: float8 has no fill kernel everywhere
                cache[self._zeroed_blocks:end].view(torch.uint8).zero_()
        self._zeroed_blocks = end

    def copy_kv_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy KV blocks (src, dst) in every layer (a beam that forks from another takes a
        copy of the block it writes next; engine/engine_beams.py), queued on the device in
        order before the next step; on every rank."""
        if not copies:
            return
        if self.channel is not None:
            self.channel.send_copies(Command.COPY_KV_BLOCKS, copies)
        self._zero_blocks_up_to(max(max(pair) for pair in copies) + 1)  # (or a later first use wipes them)
        src = torch.tensor([a for a, _ in copies], device=self.device)
        dst = torch.tensor([b for _, b in copies], device=self.device)
        for layer in self.attn_layers:
            for cache in layer.kv_cache[:layer.cache_tensors]:
                raw = cache.view(torch.uint8)  # (as bytes, as zeroing: float8 everywhere)
                raw.index_copy_(0, dst, raw.index_select(0, src))

    def release_kv_cache(self) -> None:
        if self.channel is not None and self.num_blocks:
            self.channel.send(Command.RELEASE_KV)
        for layer in self.attn_layers:
            layer.kv_cache = None
        self.num_blocks = 0
        if self.graphs is not None:
            self.graphs.reset(None)

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> Iterator[torch.Tensor]:
        """Logits (float32) for the rows in `inputs.lm_head_indices`, in passes: the
        sampled rows in one, then the prompt-logprob rows PROMPT_LOGIT_ROWS at a time. Every
        rank runs the same passes (each joins the LM head's all-gather)."""
        if self.channel is not None:
            self.channel.send(Command.FORWARD, inputs=inputs)
        inputs.mark_output_rows()
        hidden = self._run_model(inputs).index_select(0, inputs.lm_head_indices)
        num_sampled = hidden.shape[0] - inputs.num_prompt_logit_rows
        if num_sampled:
            yield self.model.compute_logits(hidden[:num_sampled])
        for start in range(num_sampled, hidden.shape[0], PROMPT_LOGIT_ROWS):
            yield self.model.compute_logits(hidden[start:start + PROMPT_LOGIT_ROWS])

    @torch.inference_mode()
    def forward_no_logits(self, inputs: ModelInputs, hidden_read: bool = True) -> torch.Tensor:
        """A step no row samples in (partial prefill chunks, embedding requests): fill the
        cache; returns the final hidden states (`hidden_read` False: none of them is read,
        and a model may leave them unfinished)."""
        if self.channel is not None:
            self.channel.send(Command.FORWARD_NO_LOGITS, int(hidden_read), inputs=inputs)
        if not hidden_read:
            inputs.mark_output_rows(hidden_read=False)
        return self._run_model(inputs)

    def _run_model(self, inputs: ModelInputs) -> torch.Tensor:
        self._zero_blocks_up_to(inputs.max_block_id + 1)
        # CUDA graphs replay the base model only: a step with adapter rows runs eagerly;
        # graphs take token ids only, so a step with image rows runs eagerly too
        if (self.graphs is not None and inputs.image_rows is None
                and (not inputs.lora_segments or self.graphs.replays_lora)):
            hidden = self.graphs.run(inputs)
            if hidden is not None:
                return hidden
        self._copy_states(inputs.state_restores)
        with attention_context(inputs.attn), lora_context(LoRAPass(inputs.lora_segments, inputs.lora_row_slots)):
            hidden = self.model(inputs.input_ids, inputs.positions, **inputs.model_kwargs)
        self._copy_states(inputs.state_saves)
        return hidden

    def fork_states(self, copies: list[tuple[int, int]]) -> None:
        """Between steps, copy recurrent states (src slot, dst slot) on every rank (a beam's
        fork takes its parent's; engine/engine_beams.py)."""
        if self.channel is not None and copies:
            self.channel.send_copies(Command.COPY_STATES, copies)
        self._copy_states(copies)

    def _copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Copy recurrent states between slots (engine/state_cache.py's snapshots), every
        layer's, in the device's order of work."""
        if not copies:
            return
        src = torch.tensor([a for a, _ in copies], device=self.device)
        dst = torch.tensor([b for _, b in copies], device=self.device)
        for layer in self.state_layers:
            for tensor in layer.state:
                tensor.index_copy_(0, dst, tensor.index_select(0, src))

    def _encode_images(self, inputs: ModelInputs) -> None:
        """The image features of the step's placeholder rows, encoding each image the first
        time a step reaches it; images a prompt is past are let go (unless siblings of its
        group will read them)."""
        parts = []
        done: dict[int, tuple] = {}  # per prompt (siblings share one): its images, rows all past, kept
        for rows in inputs.image_slices:
            parts.append(rows.images.features(rows.lo, rows.hi, self._encode_image))
            _, before, keep = done.get(id(rows.images), (None, rows.hi, False))
            done[id(rows.images)] = (rows.images, min(before, rows.hi), keep or rows.keep)
        for images, before, keep in done.values():  # after the step's reads: siblings share its features
            if not keep:
                images.release(before=before)
        inputs.image_embeds = torch.cat(parts).to(self.device)

    def _encode_image(self, encoder_inputs: dict[str, torch.Tensor], content_hash: bytes) -> torch.Tensor:
        """One image's features: from the encoder cache when these pixels were seen."""
        cached = self.encoder_cache.get(content_hash)
        if cached is not None:
            return cached.to(self.device, non_blocking=True)
        features = self.model.encode_images(encoder_inputs)
        self.encoder_cache.put(content_hash, features)
        return features

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> StepResult:
        """Run one step: the sampled token (and its logprobs) of each sequence that samples,
        and the prompt logprobs this step computed."""
        return self.launch(scheduled).result()

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledSeq], previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step; its sampled tokens stay on the device until `result()`. With
        `previous` (async scheduling), rows whose token that step is sampling take it from
        its device tensor."""
        inputs = build_inputs(scheduled, self.block_size, self.device,
                              None if previous is None else previous.sampled_index,
                              self._activate_loras(scheduled))
        if inputs.image_slices:
            self._encode_images(inputs)
        if inputs.deferred_rows is not None:
            inputs.input_ids.index_copy_(
                0, inputs.deferred_rows, previous.token_ids.index_select(0, inputs.deferred_indices))
        if inputs.pooling_rows:  # embedding requests (a pooling engine runs nothing else)
            hidden = self.forward_no_logits(inputs)
            return LaunchedStep(inputs, pooled=self._classified(self.pooler.pool(hidden, inputs.pooling_rows)))
        if not inputs.sampled_rows and not inputs.prompt_rows:  # only partial prefill chunks
            self.forward_no_logits(inputs, hidden_read=False)
            return LaunchedStep(inputs)
        passes = self.forward(inputs)
        try:
            # seeded sequences verifying drafts: their generators before the draws, to be
            # rewound to the tokens kept (launched_step.py)
            states = {item.seq: item.seq.generator.get_state() for item in inputs.sampled_rows
                      if item.draft_token_ids and item.seq.generator is not None and not item.seq.params.greedy}
            sampled = self._sample(inputs, passes)
            return LaunchedStep(inputs, sampled, self._prompt_logprobs(inputs, passes), states)
        finally:
            if self.channel is not None:  # the other ranks join every pass's all-gather, even
                for _ in passes:          # when sampling failed here: run what is left
                    pass

    def _classified(self, pooled: list[tuple]) -> list[tuple]:
        """A classifier's pooled rows through its head: each prompt's label logits (float32)."""
        if self.pooler.config.task != "classify" or not pooled:
            return pooled
        logits = classify_rows(self.model, torch.stack([vector for _, vector in pooled]).to(self.dtype)).float()
        return [(seq, row) for (seq, _), row in zip(pooled, logits)]

    def _activate_loras(self, scheduled: list[ScheduledSeq]) -> dict[int, int] | None:
        """The slot of each adapter the step uses, loading those not resident (on every
        rank)."""
        adapters = [item.seq.lora for item in scheduled if item.seq.lora is not None]
        if not adapters:
            return None
        if self.lora is None:
            raise RuntimeError("a sequence has a LoRA adapter but LoRA is not enabled")
        slots, loads = self.lora.activate(adapters)
        if self.channel is not None:
            for slot, adapter in loads:
                self.channel.send_lora(slot, adapter)
        return slots

    def _sample(self, inputs: ModelInputs, passes: Iterator[torch.Tensor]) -> SamplerOutput | None:
        """The sampled rows' tokens and logprobs (on the device), from the first pass."""
        if not inputs.sampled_rows:
            return None
        # a row per logits row: a sequence with k drafts has k + 1, the j-th seeing the
        # first j drafts as its history
        seqs = [item.seq for item in inputs.sampled_rows for _ in range(len(item.draft_token_ids) + 1)]
        drafts = None
        if any(item.draft_token_ids for item in inputs.sampled_rows):
            drafts = [item.draft_token_ids[:j] for item in inputs.sampled_rows
                      for j in range(len(item.draft_token_ids) + 1)]
        batch = SamplingBatch(params=[s.params for s in seqs],
                              generators=[s.generator for s in seqs],
                              token_ids=[s.token_ids for s in seqs],
                              num_prompt_tokens=[s.num_prompt_tokens for s in seqs],
                              grammars=[s.active_grammar for s in seqs],
                              draft_token_ids=drafts,
                              forced_token_ids=[s.forced_token for s in seqs])
        return self.sampler.sample(next(passes), batch)

    @staticmethod
    def _prompt_logprobs(inputs: ModelInputs, passes: Iterator[torch.Tensor]
                         ) -> list[tuple[PromptRows, list[TokenLogprobs]]]:
        """Prompt logprobs from the passes after the first, one pass at a time."""
        if not inputs.prompt_rows:
            return []
        targets = torch.tensor([t for r in inputs.prompt_rows for t in r.next_token_ids])
        num_top = [r.item.seq.params.prompt_logprobs for r in inputs.prompt_rows
                   for _ in range(r.count)]
        info: list[TokenLogprobs] = []
        for logits in passes:
            done = len(info)
            info += prompt_logprobs(logits, targets[done:done + logits.shape[0]].to(logits.device),
                                    num_top[done:done + logits.shape[0]])
            del logits  # before the generator computes the next pass
        out, offset = [], 0
        for r in inputs.prompt_rows:
            out.append((r, info[offset:offset + r.count]))
            offset += r.count
        return out
