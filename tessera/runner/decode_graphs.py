"""Decode steps replayed from captured kernel graphs (CPU; `--enforce-eager` turns it off).

A decode-only step of up to `BUCKETS[-1]` sequences runs the model on static input
buffers, padded up to the next bucket size. The first step at a bucket size runs the
forward pass under `capture()` (tessera/ops/cpu/graph.py), which records its kernel calls;
later steps at that size copy their inputs into the buffers and replay the calls from C,
with no Python in between. When the pass runs anything but kernels (a dtype or model
without CPU kernels, or an op that copies at this row count), the step's result is still
used and that bucket runs eagerly from then on.

Padded rows read token 0 at position 0, write no KV (slot -1) and attend over one cached
token of block 0 (their output is discarded); a bucket costs a few rows of extra work,
where one graph per batch size would cost a capture (and its memory) per size.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch
from torch import nn

from tessera.ops.attention import AttentionMetadata, attention_context
from tessera.ops.cpu.build import KernelBuildError
from tessera.ops.cpu.graph import KernelGraph, capture
from tessera.runner.inputs import ModelInputs

logger = logging.getLogger(__name__)

# every size up to 8 (no padding where batches are small, and int8's kernel switches path
# at 8 rows, so a padded step would differ from its eager twin), then steps of 8
BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32)


@dataclass
class _Captured:
    graph: KernelGraph
    hidden: torch.Tensor  # the pass's output buffer, [bucket, hidden]


class DecodeGraphs:
    """Owned by the model runner, which calls `reset` whenever it replaces the KV cache
    (the graphs hold its pointers)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._graphs: dict[int, _Captured] = {}
        self._eager: set[int] = set()  # buckets whose pass cannot be replayed
        self._refusals_logged: set[str] = set()
        self._table_width = 0

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    @property
    def eager_sizes(self) -> list[int]:
        """Buckets whose pass could not be captured (they run eagerly)."""
        return sorted(self._eager)

    def reset(self, num_blocks: int) -> None:
        """Drop every graph; block tables may now be `num_blocks` wide (no sequence can hold
        more blocks than the cache has)."""
        self._graphs.clear()
        self._eager.clear()
        self._table_width = num_blocks
        size = BUCKETS[-1]
        # one set of input buffers serves every bucket (a bucket reads its first rows)
        self._ids = torch.zeros(size, dtype=torch.int64)
        self._positions = torch.zeros(size, dtype=torch.int64)
        self._slots = torch.full((size,), -1, dtype=torch.int64)
        self._tables = torch.zeros((size, max(1, num_blocks)), dtype=torch.int32)
        self._lens = torch.ones(size, dtype=torch.int32)
        self._starts = torch.arange(size + 1, dtype=torch.int32)

    def run(self, inputs: ModelInputs) -> torch.Tensor | None:
        """The hidden states [rows, hidden] of a decode-only step, or None when this step
        is not one a graph runs (prefill rows, too many rows, tables wider than the cache)."""
        meta = inputs.attn
        rows = inputs.input_ids.shape[0]
        if (meta.num_decodes != rows or rows > BUCKETS[-1]
                or meta.block_tables.shape[1] > self._table_width):
            return None
        bucket = BUCKETS[bisect.bisect_left(BUCKETS, rows)]
        if bucket in self._eager:
            return None
        self._fill(inputs, rows, bucket)
        captured = self._graphs.get(bucket)
        if captured is None:
            return self._capture(bucket, meta)[:rows]
        captured.graph.replay()
        return captured.hidden[:rows]

    def _fill(self, inputs: ModelInputs, rows: int, bucket: int) -> None:
        meta = inputs.attn
        self._ids[:rows].copy_(inputs.input_ids)
        self._positions[:rows].copy_(inputs.positions)
        self._slots[:rows].copy_(meta.slot_mapping)
        self._tables[:rows, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        self._lens[:rows].copy_(meta.seq_lens)
        if bucket > rows:  # rows left over from a larger step
            self._ids[rows:bucket] = 0
            self._positions[rows:bucket] = 0
            self._slots[rows:bucket] = -1
            self._tables[rows:bucket, 0] = 0
            self._lens[rows:bucket] = 1

    def _metadata(self, bucket: int, step: AttentionMetadata) -> AttentionMetadata:
        pad = bucket - step.num_decodes
        return AttentionMetadata(
            slot_mapping=self._slots[:bucket], block_tables=self._tables[:bucket],
            seq_lens=self._lens[:bucket], query_start_loc=self._starts[:bucket + 1],
            num_decodes=bucket, num_decode_tokens=bucket,
            # host copies: only torch builders read them (and then no graph is kept), but
            # the capturing pass's own result must be right
            seq_lens_list=step.seq_lens_list + [1] * pad, query_lens_list=[1] * bucket,
            has_padding=True)

    def _capture(self, bucket: int, step: AttentionMetadata) -> torch.Tensor:
        started = time.perf_counter()
        with attention_context(self._metadata(bucket, step)), capture() as graph:
            hidden = self.model(self._ids[:bucket], self._positions[:bucket])
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
