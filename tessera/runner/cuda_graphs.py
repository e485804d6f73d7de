"""Decode steps replayed from CUDA graphs (`--enforce-eager` turns it off).

Captured once per KV cache, at start-up: one graph per bucket (1, 2, 4, 8, then steps of 16,
beyond 256 of 64, up to the most rows a decode step has: max_num_seqs, times 1 + k with
k speculative tokens). First one eager pass per bucket with kernel tuning open
(tessera/ops/kernel_tuning.py: a linear over few rows times its Triton kernels against
cuBLAS and keeps the fastest). Then the graphs, largest first into one memory pool (a
smaller graph reuses the larger one's intermediate memory), each after an eager warm-up
pass on a side stream (Triton compiles, cuBLAS picks its algorithms). Captured with the host-side lengths set to
max_model_len, so the decode kernel's grid covers any sequence a later step can hold
(partitions past a sequence's end do nothing). Each graph is then checked once against the
eager pass on the same inputs; a capture that fails or disagrees turns graphs off with a
warning, and every step runs eagerly. So does a model whose decode pass syncs with the host
(mixture-of-experts routing, rotary scaling chosen by length): the first warm-up pass runs
under tessera/runner/host_syncs.py, and what it records is named instead of captured.

A decode-only step copies its inputs into the static buffers (tessera/runner/graph_inputs.py)
and replays its bucket's graph: a few kernel launches instead of one per op.
"""
from __future__ import annotations

import contextlib
import logging
import time

import torch
from torch import nn

from tessera.ops.attention import attention_context
from tessera.ops.kernel_tuning import kernel_tuning, tuned_row_limit
from tessera.runner.graph_inputs import GraphLimits, StaticDecodeInputs
from tessera.runner.host_syncs import HostSyncRecorder
from tessera.runner.inputs import ModelInputs

logger = logging.getLogger(__name__)


def cuda_buckets(max_rows: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 16 to 256, then of 64, up to the first that holds
    max_rows (beyond 256 rows, 64 more pad a step by under 25%, and speculative decoding's
    max_num_seqs x (1 + k) rows would otherwise take 4x the graphs to capture)."""
    buckets = [1]
    while buckets[-1] < max_rows:
        last = buckets[-1]
        step = 16 if last < 256 else 64
        buckets.append(last * 2 if last < 8 else (last // step + 1) * step)
    return tuple(buckets)


class CudaDecodeGraphs:
    """Owned by the model runner: `reset` on every new KV cache (captures), `run` per step."""

    # captured without LoRA: steps with adapter rows run eagerly (capturing torch's
    # lora_rows with the slots buffer, as the CPU graphs do, awaits a GPU to test it on)
    replays_lora = False

    def __init__(self, model: nn.Module, block_size: int, device: torch.device):
        self.model = model
        self.block_size = block_size
        self.device = device
        self.inputs: StaticDecodeInputs | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def reset(self, limits: GraphLimits | None) -> None:
        """Drop every graph; with `limits`, capture the buckets for steps within them
        (the runner has bound a KV cache with block 0 zeroed)."""
        self._graphs.clear()
        self.inputs = None
        if limits is None:
            return
        self.inputs = StaticDecodeInputs(cuda_buckets(limits.max_rows), limits, self.block_size,
                                         self.device)
        started = time.perf_counter()
        try:
            self._capture_all(limits)
        except Exception as exc:  # noqa: BLE001 - any failure: serve eagerly, say why
            logger.warning("no CUDA decode graphs, decode runs eagerly: %s", exc)
            self._graphs.clear()
            self.inputs = None
            return
        logger.info("captured %d CUDA decode graphs (%s rows) in %.1f s", len(self._graphs),
                    ", ".join(map(str, self.inputs.buckets)), time.perf_counter() - started)

    def run(self, inputs: ModelInputs) -> torch.Tensor | None:
        """The hidden states [rows, hidden] of a decode-only step, or None when no graph
        runs this step."""
        if self.inputs is None:
            return None
        bucket = self.inputs.bucket_for(inputs)
        if bucket is None:
            return None
        self.inputs.fill(inputs, bucket)
        graph, hidden = self._graphs[bucket]
        graph.replay()
        return hidden[:inputs.input_ids.shape[0]]

    def _forward(self, bucket: int, limits: GraphLimits) -> torch.Tensor:
        meta = self.inputs.metadata(bucket, [limits.max_model_len] * bucket)
        with attention_context(meta):
            return self.model(self.inputs.ids[:bucket], self.inputs.positions[:bucket])

    def _tune_kernels(self, limits: GraphLimits) -> None:
        """One eager pass at each bucket's size where a builder measures (kernel_tuning's
        row limit), and the LM head over its rows, with kernel tuning open: builders that
        choose their kernel by measurement (skinny_linear.py) do it now, before the
        graphs fix what each step launches."""
        with kernel_tuning():
            for bucket in self.inputs.buckets:
                if bucket <= tuned_row_limit():
                    self.model.compute_logits(self._forward(bucket, limits))
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def _capture_all(self, limits: GraphLimits) -> None:
        static = self.inputs
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", 2)
        # random tokens, so the check below compares something other than one repeated row
        static.ids.copy_(torch.randint(0, vocab, static.ids.shape, device=self.device))
        # every row a padded row otherwise: position 0, no KV write, one key of block 0
        static.positions.zero_()
        static.slots.fill_(-1)
        static.tables.zero_()
        static.lens.fill_(1)
        self._tune_kernels(limits)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for bucket in reversed(static.buckets):
            side.wait_stream(torch.cuda.current_stream(self.device))
            # the first (largest) pass is checked for host syncs; the others run the same ops
            first = bucket == static.buckets[-1]
            with torch.cuda.stream(side), HostSyncRecorder() if first else contextlib.nullcontext() as syncs:
                eager = self._forward(bucket, limits).clone()
            if first and syncs.ops:  # before capturing, where CUDA would refuse them mid-graph
                raise RuntimeError(f"the decode pass syncs with the host ({', '.join(syncs.ops)}), "
                                   f"which a CUDA graph cannot replay")
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(bucket, limits)
            graph.replay()
            torch.cuda.synchronize(self.device)
            if not torch.allclose(hidden.float(), eager.float(), rtol=2e-2, atol=2e-2):
                worst = (hidden.float() - eager.float()).abs().max().item()
                raise RuntimeError(f"the {bucket}-row graph disagrees with the eager pass (max |diff| {worst:.3g})")
            self._graphs[bucket] = (graph, hidden)
