"""The driver -> ranks step channel: what the other ranks need to run a step, as two
broadcasts of int64 tensors (a fixed header, then every index tensor concatenated).

Scheduling, sampling and detokenization stay on the driver (rank 0); the others receive
token ids, positions, slot mapping, block tables and lengths, run the same forward, and
take part in the collectives inside it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessera.ops.attention import AttentionMetadata
from tessera.lora.adapter import LoRAAdapter, adapter_from_bytes, adapter_to_bytes
from tessera.lora.layer import row_slots_for
from tessera.runner.inputs import ModelInputs


class Command(enum.IntEnum):
    SHUTDOWN = 0
    FORWARD = 1            # run the model and the LM head on lm_head_indices
    FORWARD_NO_LOGITS = 2  # only partial prefill chunks: no rows sample
    ALLOCATE_KV = 3        # arg = number of blocks
    RELEASE_KV = 4
    LOAD_LORA = 5          # arg = slot; then the adapter as safetensors bytes
    COPY_KV_BLOCKS = 6     # arg = number of (src, dst) block pairs, then the pairs (a beam's fork)
    COPY_STATES = 7        # arg = number of (src, dst) state slot pairs, then the pairs (likewise)


# command, arg, tokens, seqs, table width, decodes, logit rows, max block id, has padding,
# prompt-logprob rows (the last logit rows, which the LM head takes in passes of their own),
# LoRA segments (for LOAD_LORA: the length of the adapter's bytes), image rows, their
# features' width, whether they have 3-D (M-RoPE) positions, whether the prefill rows have
# key limits (an image attending to itself), whether the rows have state slots (recurrent
# layers), and how many state copies come before and after the forward (their snapshots)
HEADER_LEN = 18


@dataclass
class Received:
    command: Command
    arg: int = 0
    inputs: ModelInputs | None = None
    lora: LoRAAdapter | None = None  # LOAD_LORA: the driver's adapter
    copies: list[tuple[int, int]] | None = None  # COPY_KV_BLOCKS / COPY_STATES: the pairs


class StepChannel:
    def __init__(self, device: torch.device):
        self.device = device  # gloo carries CPU tensors, NCCL device tensors

    def send(self, command: Command, arg: int = 0, inputs: ModelInputs | None = None) -> None:
        """Rank 0: announce a command (and its inputs) to every other rank."""
        header = torch.zeros(HEADER_LEN, dtype=torch.long)
        header[0], header[1] = int(command), arg
        payload = None
        if inputs is not None:
            a = inputs.attn
            images = inputs.image_embeds
            header[2:] = torch.tensor([inputs.input_ids.numel(), a.num_seqs, a.block_tables.shape[1],
                                       a.num_decodes, inputs.lm_head_indices.numel(),
                                       inputs.max_block_id, int(a.has_padding),
                                       inputs.num_prompt_logit_rows, len(inputs.lora_segments),
                                       0 if images is None else images.shape[0],
                                       0 if images is None else images.shape[1],
                                       int(inputs.image_positions is not None),
                                       int(a.key_limits is not None), int(a.state_slots is not None),
                                       len(inputs.state_restores), len(inputs.state_saves)])
            segments = torch.tensor(inputs.lora_segments, dtype=torch.long).flatten()
            parts = [inputs.input_ids.long(), inputs.positions.long(), a.slot_mapping.long(),
                     a.block_tables.long().flatten(), a.seq_lens.long(),
                     a.query_start_loc.long(), inputs.lm_head_indices.long(), segments]
            if images is not None:
                parts.append(inputs.image_rows.long())
                if inputs.image_positions is not None:
                    parts.append(inputs.image_positions.long().flatten())
            if a.key_limits is not None:
                parts.append(a.key_limits.long())
            if a.state_slots is not None:
                parts += [a.state_slots.long(), torch.tensor(a.state_fresh_list, dtype=torch.long)]
            parts.append(torch.tensor(inputs.state_restores + inputs.state_saves, dtype=torch.long).flatten())
            payload = torch.cat([p.to(self.device) for p in parts])
        dist.broadcast(header.to(self.device), src=0)
        if payload is not None:
            dist.broadcast(payload, src=0)
            if inputs.image_embeds is not None:  # float32: what every backend broadcasts
                dist.broadcast(inputs.image_embeds.float().to(self.device), src=0)

    def send_lora(self, slot: int, adapter: LoRAAdapter) -> None:
        """Rank 0: every rank loads `adapter` (its factors as the driver holds them, not
        read from the folder again) into `slot`."""
        data = torch.frombuffer(bytearray(adapter_to_bytes(adapter)), dtype=torch.uint8)
        header = torch.zeros(HEADER_LEN, dtype=torch.long)
        header[0], header[1], header[2] = int(Command.LOAD_LORA), slot, data.numel()
        dist.broadcast(header.to(self.device), src=0)
        dist.broadcast(data.to(self.device), src=0)

    def send_copies(self, command: Command, copies: list[tuple[int, int]]) -> None:
        """Rank 0: every rank copies these KV blocks or state slots (src, dst) in its cache."""
        header = torch.zeros(HEADER_LEN, dtype=torch.long)
        header[0], header[1] = int(command), len(copies)
        dist.broadcast(header.to(self.device), src=0)
        dist.broadcast(torch.tensor(copies, dtype=torch.long).flatten().to(self.device), src=0)

    def recv(self) -> Received:
        """Other ranks: block until the driver's next command."""
        header = torch.empty(HEADER_LEN, dtype=torch.long, device=self.device)
        dist.broadcast(header, src=0)
        (command, arg, tokens, seqs, width, decodes, rows, max_block, padded, prompt_rows, num_segments,
         image_rows, image_width, image_3d, limited, stateful, restores, saves) = header.tolist()
        command = Command(command)
        if command == Command.LOAD_LORA:
            data = torch.empty(tokens, dtype=torch.uint8, device=self.device)
            dist.broadcast(data, src=0)
            return Received(command, arg, lora=adapter_from_bytes(data.cpu().numpy().tobytes()))
        if command in (Command.COPY_KV_BLOCKS, Command.COPY_STATES):
            pairs = torch.empty(2 * arg, dtype=torch.long, device=self.device)
            dist.broadcast(pairs, src=0)
            return Received(command, arg, copies=[tuple(pair) for pair in pairs.view(-1, 2).tolist()])
        if command not in (Command.FORWARD, Command.FORWARD_NO_LOGITS):
            return Received(command, arg)
        sizes = [tokens, tokens, tokens, seqs * width, seqs, seqs + 1, rows, 3 * num_segments,
                 image_rows, 3 * image_rows * image_3d, (tokens - decodes) * limited, seqs * stateful,
                 seqs * stateful, 2 * (restores + saves)]
        payload = torch.empty(sum(sizes), dtype=torch.long, device=self.device)
        dist.broadcast(payload, src=0)
        (ids, positions, slots, tables, seq_lens, starts, lm_rows, segments, rows_of_images, image_positions,
         key_limits, state_slots, state_fresh, state_copies) = payload.split(sizes)
        seq_lens_list, starts_list = seq_lens.tolist(), starts.tolist()
        attn = AttentionMetadata(
            slot_mapping=slots, block_tables=tables.view(seqs, width).int(),
            seq_lens=seq_lens.int(), query_start_loc=starts.int(),
            num_decodes=decodes, num_decode_tokens=decodes, seq_lens_list=seq_lens_list,
            query_lens_list=[b - a for a, b in zip(starts_list, starts_list[1:])],
            has_padding=bool(padded), key_limits=key_limits if limited else None)
        if stateful:
            attn.state_slots, attn.state_slots_list = state_slots, state_slots.tolist()
            attn.state_fresh_list = [bool(f) for f in state_fresh.tolist()]
        lora_segments = [tuple(segment) for segment in segments.view(-1, 3).tolist()]
        inputs = ModelInputs(
            ids, positions, attn, lm_rows, [], max_block, num_prompt_logit_rows=prompt_rows,
            lora_segments=lora_segments, lora_row_slots=row_slots_for(lora_segments, tokens, self.device),
            lm_head_rows=lm_rows.tolist())
        copies = [tuple(pair) for pair in state_copies.view(-1, 2).tolist()]
        inputs.state_restores, inputs.state_saves = copies[:restores], copies[restores:]
        if image_rows:
            inputs.image_rows = rows_of_images
            inputs.image_embeds = torch.empty(image_rows, image_width, dtype=torch.float32, device=self.device)
            dist.broadcast(inputs.image_embeds, src=0)
            if image_3d:
                inputs.image_positions = image_positions.view(3, image_rows)
        return Received(command, arg, inputs)
