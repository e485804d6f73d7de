"""Decode steps replayed from captured kernel graphs (CPU; `--enforce-eager` turns it off).

A decode-only step of up to `BUCKETS[-1]` sequences runs the model on static input
buffers (tessera/runner/graph_inputs.py), padded up to the next bucket size. The first step
at a bucket size runs the forward pass under `capture()` (tessera/ops/cpu/graph.py), which
records its kernel calls; later steps at that size copy their inputs into the buffers and
replay the calls from C, with no Python in between. When the pass runs anything but
kernels (a dtype or model without CPU kernels, or an op that copies at this row count),
the step's result is still used and that bucket runs eagerly from then on.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from tessera.lora.layer import LoRAPass, lora_context
from tessera.ops.attention import AttentionMetadata, attention_context
from tessera.ops.cpu.build import KernelBuildError
from tessera.ops.cpu.graph import KernelGraph, capture
from tessera.runner.graph_inputs import GraphLimits, StaticDecodeInputs
from tessera.runner.inputs import ModelInputs

logger = logging.getLogger(__name__)

# every size up to 8 (no padding where batches are small, and int8's kernel switches path
# at 8 rows, so a padded step would differ from its eager twin), then steps of 8
BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32)


@dataclass
class _Captured:
    graph: KernelGraph
    hidden: torch.Tensor  # the pass's output buffer, [bucket, hidden]


class CpuDecodeGraphs:
    """Owned by the model runner: `reset` on every new KV cache (the graphs hold its
    pointers), `run` per step."""

    replays_lora = True  # steps with LoRA rows replay too (the slots are an input buffer)

    def __init__(self, model: nn.Module, block_size: int, state_pad_slot: int | None = None):
        """`state_pad_slot`: a model with recurrent layers' spare state slot, which padded
        rows use (StaticDecodeInputs)."""
        self.model = model
        self.state_pad_slot = state_pad_slot
        self.block_size = block_size
        self.limits: GraphLimits | None = None
        self.inputs: StaticDecodeInputs | None = None
        self._graphs: dict[int, _Captured] = {}
        self._eager: set[int] = set()  # buckets whose pass cannot be replayed
        self._refusals_logged: set[str] = set()

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    @property
    def eager_sizes(self) -> list[int]:
        """Buckets whose pass could not be captured (they run eagerly)."""
        return sorted(self._eager)

    def reset(self, limits: GraphLimits | None) -> None:
        """Drop every graph; with `limits`, new buffers for steps within them (captures
        happen lazily, on each bucket's first step), without, graphs are off."""
        self._graphs.clear()
        self._eager.clear()
        self.limits = limits
        self.inputs = None if limits is None else StaticDecodeInputs(BUCKETS, limits, self.block_size,
                                                                     torch.device("cpu"), self.state_pad_slot)

    def run(self, inputs: ModelInputs) -> torch.Tensor | None:
        """The hidden states [rows, hidden] of a decode-only step, or None when no graph
        runs this step (see StaticDecodeInputs.bucket_for; or its bucket runs eagerly)."""
        if self.inputs is None:
            return None
        bucket = self.inputs.bucket_for(inputs)
        if bucket is None or bucket in self._eager:
            return None
        rows = inputs.input_ids.shape[0]
        self.inputs.fill(inputs, bucket)
        captured = self._graphs.get(bucket)
        if captured is None:
            return self._capture(bucket, inputs.attn)[:rows]
        captured.graph.replay()
        return captured.hidden[:rows]

    def _capture(self, bucket: int, step: AttentionMetadata) -> torch.Tensor:
        started = time.perf_counter()
        # host copies: only torch builders read them (and then no graph is kept), but
        # the capturing pass's own result must be right
        meta = self.inputs.metadata(bucket, step.seq_lens_list + [1] * (bucket - step.num_decodes))
        # LoRA layers (when enabled) record their per-row op, reading the slots buffer
        lora = LoRAPass(row_slots=self.inputs.lora_slots[:bucket])
        with attention_context(meta), lora_context(lora), capture() as graph:
            hidden = self.model(self.inputs.ids[:bucket], self.inputs.positions[:bucket])
        reason = None
        if not graph.replayable:
            ops = ", ".join(sorted(set(graph.refused))[:4])
            reason = f"the forward pass runs {ops}, which a replay would skip"
        else:
            try:
                graph.prepare()  # compile the replayer now, not inside a later step
            except (KernelBuildError, OSError) as exc:
                reason = f"the replayer did not build: {exc}"
        if reason is not None:
            self._eager.add(bucket)
            log = logger.info if reason not in self._refusals_logged else logger.debug
            self._refusals_logged.add(reason)
            log("decode steps of %d rows run eagerly: %s", bucket, reason)
            return hidden
        graph.keep.append(hidden)
        self._graphs[bucket] = _Captured(graph, hidden)
        logger.info("captured the decode step for %d rows: %d kernel calls, %.1f MiB of buffers, %.0f ms",
                    bucket, len(graph.calls), graph.held_bytes / 2**20, (time.perf_counter() - started) * 1e3)
        return hidden
