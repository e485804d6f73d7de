"""Paged decode attention in Triton: one query token per sequence against its cached
blocks, GQA without repeating K/V, sliding windows, soft-capping and attention sinks.

Decode is bound by reading the cache, so each program reads each cached K/V row once for
a whole GQA group: a program takes one (sequence, KV head, partition of the context) and
puts the group's query heads on the rows of a [group, tokens] score tile (tl.dot; rows past
the group are masked). It walks its partition in tiles of TILE_N tokens whatever the cache
block size, looking the block of every token up in the table, and keeps a running max /
sum / weighted V per query head (online softmax). The partitions are merged without a
second launch where that is short: the last program of a group to finish (a counter,
semaphores.py) merges them, and a group's only live partition writes the output itself;
where the merge would be a long loop for one program (many partitions of wide heads) a
second kernel does it, spread over (sequence, head). A head's attention sink (gpt-oss)
joins its softmax's denominator in the merge.
Partitions wholly before a sliding window or past a sequence's end read and write nothing
and the merge reads only the live ones: a captured graph's grid covers max_model_len, so at
replay most of its partitions are such.

Partitions shrink (down to one tile) while the grid would leave the GPU's SMs idle: batch-1
decode over a long context still spreads over many programs. A group of query heads wider
than one tile allows (MLA's 576-wide latent heads) is split over several programs, each
reading the group's K/V.

An 8-bit float cache (kv_quant.py, KV_FORMAT 1 e4m3fn / 2 e5m2) is passed as bytes and
widened in-kernel to the query's dtype (tessera/ops/triton/fp8.py; by the GPU's own fp8
conversions from sm_89 on), half the bytes read per cached token of a bf16 model;
KV_FORMAT 0 (the model dtype) compiles to the plain loads. A bf16 query over such a cache
is multiplied in float16 (HALF_DOTS): both fp8 formats widen exactly to float16 in one
conversion per pair of values (Hopper's cvt.rn.f16x2.e4m3x2; e5m2 is float16's top byte),
while reaching bf16 takes two more per value (through float32), which at batch 256 would
cost more time than reading the cache (session 30's fp8 throughput was below bf16's).
float16 keeps the bf16 query's bits (more mantissa, range to 65504, which queries stay
well within; heads wider than 256, MLA's absorbed latent queries among them, keep bf16)
and holds the probabilities more finely than bf16 would.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from tessera.ops.attention.kv_quant import QUANTIZED_KV, kv_format
from tessera.ops.attention.metadata import AttentionMetadata
from tessera.ops.registry import register_op
from tessera.ops.triton import semaphores
from tessera.ops.triton.availability import triton_missing
from tessera.ops.triton.launch import launch_options

PARTITION_SIZE = 512  # the most tokens one program takes
TILE_N = 64           # tokens per inner step (fewer for wide rows: key_tile)
MIN_PROGRAMS = 264    # about two programs per SM on an H100 (132 SMs)
MERGE_CHUNK = 32      # partitions merge_kernel reads at a time, 256 wide or narrower
MERGE_TILE = 2048     # floats of weighted V in a fused merge's tile (merge_plan)
MAX_FUSED_MERGE_STEPS = 16
NO_WINDOW = 1 << 30   # "no sliding window" as a window longer than any context


@lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    # module globals: the interpreter does not see this closure's names (fp8.py)
    global fp8, finish, grid_dependency, merge_group
    from tessera.ops.triton import fp8, grid_dependency

    # The lengths, partition and table sizes change from step to step: left unspecialised,
    # one compile serves every step (Triton otherwise compiles a variant per value that is 1
    # or a multiple of 16, each taking a second mid-serving).
    @triton.jit
    def finish(o, total, m_all, heads, h_mask, d, d_mask, out_ptr, sinks_ptr, seq, num_heads, head_size,
               USE_SINKS: tl.constexpr):
        """Rows [heads] of the output from a weighted V sum, its softmax denominator and the
        max it is scaled to; a head's sink (gpt-oss) joins the denominator."""
        if USE_SINKS:  # the sink's exp in the denominator, everything rescaled to max(m, sink)
            sink = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32)
            top = tl.maximum(m_all, sink)
            kept = tl.exp(m_all - top)
            o = o * (kept / (total * kept + tl.exp(sink - top)))[:, None]
        else:
            o = o / total[:, None]
        tl.store(out_ptr + (seq * num_heads + heads)[:, None] * head_size + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])

    @triton.jit
    def merge_group(m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, seq, head0, head_end, lo, hi,
                    num_heads, head_size, num_partitions, BLOCK_D: tl.constexpr, MERGE_G: tl.constexpr,
                    MERGE_P: tl.constexpr, USE_SINKS: tl.constexpr):
        """Heads [head0, head_end) from their live partitions [lo, hi), MERGE_G heads x
        MERGE_P partitions a tile, each tile one pass (its max, sum and weighted V loaded
        together, rescaled to a running max), so a short context's merge is one round trip
        to memory: a group's in the fused merge, one head per program in merge_kernel. The
        parts are read past L1 (.cg): in the fused merge, other SMs wrote them."""
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_size
        p = tl.arange(0, MERGE_P)
        for h0 in range(head0, head_end, MERGE_G):
            heads = h0 + tl.arange(0, MERGE_G)
            h_mask = heads < head_end
            row = (seq * num_heads + heads) * num_partitions
            m_run = tl.zeros([MERGE_G], dtype=tl.float32) - float("inf")
            total = tl.zeros([MERGE_G], dtype=tl.float32)
            o = tl.zeros([MERGE_G, BLOCK_D], dtype=tl.float32)
            for p0 in range(lo, hi, MERGE_P):
                mask = h_mask[:, None] & (p0 + p < hi)[None, :]
                at = row[:, None] + p0 + p[None, :]
                m = tl.load(m_ptr + at, mask=mask, other=-float("inf"), cache_modifier=".cg")
                l = tl.load(l_ptr + at, mask=mask, other=0.0, cache_modifier=".cg")
                acc = tl.load(acc_ptr + at[:, :, None] * head_size + d[None, None, :],
                              mask=mask[:, :, None] & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m_run, tl.max(m, axis=1))
                m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a masked head: nothing yet
                alpha = tl.exp(m_run - m_safe)
                w = tl.where(mask & (l > 0), tl.exp(m - m_safe[:, None]), 0.0)
                o = o * alpha[:, None] + tl.sum(w[:, :, None] * acc, axis=1)
                total = total * alpha + tl.sum(w * l, axis=1)
                m_run = m_new
            finish(o, total, m_run, heads, h_mask, d, d_mask, out_ptr, sinks_ptr, seq, num_heads, head_size,
                   USE_SINKS)

    @triton.jit(do_not_specialize=["table_width", "num_partitions", "partition"])
    def partial_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr,
                       m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, counters_ptr, scale, softcap, window,
                       num_heads, num_kv_heads, head_size, table_width, num_partitions, partition, head_chunks,
                       BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                       TILE: tl.constexpr, USE_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                       KV_FORMAT: tl.constexpr, HW_FP8: tl.constexpr, FUSED_MERGE: tl.constexpr,
                       MERGE_G: tl.constexpr, MERGE_P: tl.constexpr, USE_SINKS: tl.constexpr,
                       HALF_DOTS: tl.constexpr, PDL: tl.constexpr):
        grid_dependency.start(PDL)
        seq = tl.program_id(0)
        kv_head = tl.program_id(1) // head_chunks  # a group wider than BLOCK_G takes several programs
        chunk = tl.program_id(1) % head_chunks
        part = tl.program_id(2)
        length = tl.load(lens_ptr + seq)
        first = tl.maximum(length - window, 0)  # window: the host passes a huge one for "none"
        start = tl.maximum(part * partition, first)
        end = tl.minimum((part + 1) * partition, length)
        # Partitions outside [first, length) read and write nothing (the merge skips them):
        # a captured graph's grid covers max_model_len, so most of its partitions are these.
        if start < end:
            group = num_heads // num_kv_heads
            g = chunk * BLOCK_G + tl.arange(0, BLOCK_G)
            g_mask = g < group
            heads = kv_head * group + g
            d = tl.arange(0, BLOCK_D)
            d_mask = d < head_size
            q = tl.load(q_ptr + (seq * num_heads + heads)[:, None] * head_size + d[None, :],
                        mask=g_mask[:, None] & d_mask[None, :], other=0.0)
            if HALF_DOTS:  # a bf16 query over an 8-bit cache: the dots in float16 (the module docstring)
                q = q.to(tl.float16)
            m_i = tl.zeros([BLOCK_G], dtype=tl.float32) - float("inf")
            l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
            acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
            row = num_kv_heads * head_size
            offs = tl.arange(0, TILE)
            for pos0 in range((start // TILE) * TILE, end, TILE):
                pos = pos0 + offs
                valid = (pos >= start) & (pos < end)
                block = tl.load(tables_ptr + seq * table_width + pos // BLOCK_SIZE, mask=valid, other=0)
                base = (block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE) * row + kv_head * head_size
                kv_mask = valid[:, None] & d_mask[None, :]
                # keys skip the inf/NaN check (registers: tests/ops/triton_compile.py); values keep it
                k = fp8.load_kv(k_cache_ptr + base[:, None] + d[None, :], kv_mask, q, KV_FORMAT, False, HW_FP8)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                if USE_SOFTCAP:
                    s = softcap * (2.0 / (1.0 + tl.exp(-2.0 * s / softcap)) - 1.0)  # softcap * tanh(s / softcap)
                s = tl.where(valid[None, :], s, -float("inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing valid yet
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                v = fp8.load_kv(v_cache_ptr + base[:, None] + d[None, :], kv_mask, q, KV_FORMAT, True, HW_FP8)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                m_i = m_new
            lo = first // partition  # the live partitions: [lo, hi)
            hi = tl.minimum((length + partition - 1) // partition, num_partitions)
            if FUSED_MERGE and hi - lo == 1:  # the only live partition: the output itself
                finish(acc, l_i, m_i, heads, g_mask, d, d_mask, out_ptr, sinks_ptr, seq, num_heads, head_size,
                       USE_SINKS)
            else:
                out = (seq * num_heads + heads) * num_partitions + part
                tl.store(m_ptr + out, m_i, mask=g_mask)
                tl.store(l_ptr + out, l_i, mask=g_mask)
                tl.store(acc_ptr + out[:, None] * head_size + d[None, :], acc,
                         mask=g_mask[:, None] & d_mask[None, :])
                if FUSED_MERGE:  # the last of the group's live partitions to finish merges them
                    tl.debug_barrier()  # every thread's stores precede the release below
                    counter = counters_ptr + seq * tl.num_programs(1) + tl.program_id(1)
                    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == hi - lo - 1:
                        head0 = kv_head * group + chunk * BLOCK_G
                        merge_group(m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, seq, head0,
                                    tl.minimum(head0 + BLOCK_G, (kv_head + 1) * group), lo, hi, num_heads,
                                    head_size, num_partitions, BLOCK_D, MERGE_G, MERGE_P, USE_SINKS)
                        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero for the next launch

    @triton.jit(do_not_specialize=["num_partitions", "partition"])
    def merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, lens_ptr, sinks_ptr, window, num_heads, head_size,
                     num_partitions, partition, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
                     USE_SINKS: tl.constexpr, PDL: tl.constexpr):
        grid_dependency.start(PDL)
        # only the partitions the first kernel wrote (those within [first, length))
        seq = tl.program_id(0)
        length = tl.load(lens_ptr + seq)
        lo = tl.maximum(length - window, 0) // partition
        hi = tl.minimum((length + partition - 1) // partition, num_partitions)  # the grid's, at most
        head = tl.program_id(1)
        merge_group(m_ptr, l_ptr, acc_ptr, out_ptr, sinks_ptr, seq, head, head + 1, lo, hi, num_heads,
                    head_size, num_partitions, BLOCK_D, 1, BLOCK_P, USE_SINKS)

    return partial_kernel, merge_kernel


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """float32 models get IEEE products in tl.dot (TF32 would break fp32 parity); the
    setting is ignored for bf16/fp16 inputs."""
    return "ieee" if dtype == torch.float32 else "tf32"


def kv_cache_operands(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The caches as the kernels take them and their KV_FORMAT: as they are in the model
    dtype (0); an 8-bit float cache as its bytes (1 e4m3fn, 2 e5m2), which the kernels
    decode themselves, so no fp8 type is needed on the GPU or in the interpreter."""
    fmt = kv_format(k_cache)
    if fmt:
        return k_cache.view(torch.uint8), v_cache.view(torch.uint8), fmt
    return k_cache, v_cache, fmt


def fp8_in_hardware(cache: torch.Tensor, forced: bool | None = None) -> bool:
    """Whether the kernels widen an 8-bit cache with the GPU's fp8 conversions (compute
    capability 8.9 and up) rather than integer ops (fp8.py); `forced` overrides (tests, and
    the compile checks, which run without a GPU)."""
    if forced is not None:
        return forced
    return cache.is_cuda and torch.cuda.get_device_capability(cache.device) >= (8, 9)


def key_tile(head_size: int, dtype: torch.dtype) -> int:
    """Key tokens per step: TILE_N while a head row is at most 256 bytes (128 wide in
    bf16), then halved per doubling, since wider tiles spill registers
    (tests/ops/triton_compile.py reports registers and spills per shape). `dtype` is what
    the tile holds in registers: an 8-bit cache's rows are widened to the query's."""
    row_bytes = head_size * dtype.itemsize
    tile = TILE_N
    while row_bytes > 256 and tile > 16:
        row_bytes //= 2
        tile //= 2
    return tile


def query_heads_per_program(group: int, block_d: int) -> int:
    """The rows of a program's [heads, tokens] score tile: the whole GQA group (at least 16,
    tl.dot's minimum), but no more than 16 where the head is wider than 256 (MLA's 576-wide
    latent for 16-128 query heads): the query tile would not fit in shared memory beside
    the key and value tiles, so such a group is split over several programs."""
    block_g = _next_power_of_2(max(group, 16))
    return min(block_g, 16) if block_d > 256 else block_g


def choose_partition(batch: int, num_kv_heads: int, max_len: int, largest: int = PARTITION_SIZE) -> int:
    """Tokens per program: `largest`, halved (not below one tile) while the grid would have
    fewer than MIN_PROGRAMS programs. A pure function of the host-side shape, so a captured
    graph and an eager step of the same shape agree."""
    size = largest
    while size > TILE_N and batch * num_kv_heads * -(-max_len // size) < MIN_PROGRAMS:
        size //= 2
    return size


@dataclass(frozen=True)
class MergePlan:
    """How a decode's partitions are merged: in the partition kernel by the last program
    of each group to finish (`fused`: no second launch; a group's one live partition writes
    the output directly), a tile of `heads` x `partitions` at a time; or by merge_kernel,
    one head per program, `partitions` at a time, where that last program would loop long."""

    fused: bool
    heads: int
    partitions: int


def merge_plan(group: int, block_g: int, block_d: int, num_partitions: int) -> MergePlan:
    """The fused merge's tiles hold at most MERGE_TILE floats of weighted V (32 registers a
    thread over 4 warps: no spills beside the partition loop's); it is chosen while its
    loop takes at most MAX_FUSED_MERGE_STEPS tiles over the grid's partitions (the live
    ones are at most those): Llama-3-8B's groups of 4 heads at batch 1 over 8k tokens (64
    partitions) take 8, a short context 1. merge_kernel reads as many partition rows at a
    time as 32 of 256 wide; it keeps 64-128 query heads per KV head and MLA's 576-wide
    latent over long contexts."""
    heads = min(_next_power_of_2(min(group, block_g)), max(1, MERGE_TILE // block_d))
    partitions = max(1, MERGE_TILE // (heads * block_d))
    steps = -(-min(group, block_g) // heads) * -(-num_partitions // partitions)
    if steps <= MAX_FUSED_MERGE_STEPS:
        return MergePlan(True, heads, partitions)
    return MergePlan(False, 1, max(1, MERGE_CHUNK * 256 // max(block_d, 256)))


def partition_workspace(batch: int, num_heads: int, num_partitions: int, head_size: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per (sequence, head, partition): running max, sum and weighted V, float32, left
    uninitialised (only live partitions are written, and only they are read)."""
    m = torch.empty((batch, num_heads, num_partitions), dtype=torch.float32, device=device)
    acc = torch.empty((batch, num_heads, num_partitions, head_size), dtype=torch.float32, device=device)
    return m, torch.empty_like(m), acc


@register_op("paged_attention", name="triton_paged_decode", priority=20, devices=("cuda",),
             phases=("decode",), kv_dtypes=(None, *QUANTIZED_KV), check=triton_missing, sinks=True)
def triton_paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float, sliding_window: int | None = None,
                        softcap: float | None = None, sinks: torch.Tensor | None = None,
                        partition_size: int | None = None, hardware_fp8: bool | None = None,
                        fused_merge: bool | None = None) -> torch.Tensor:
    """query [B, Hq, D] -> [B, Hq, D] for the first `num_decodes` sequences, over caches in
    the model dtype or an 8-bit float (read widened to the query's dtype).
    `partition_size` (a power of two >= 16) overrides the automatic choice, `hardware_fp8`
    fp8_in_hardware's, `fused_merge` merge_plan's (tests)."""
    b = meta.num_decodes
    num_heads, head_size = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    max_len = max(meta.seq_lens_list[:b])
    if partition_size is None:
        partition_size = choose_partition(b, num_kv_heads, max_len)
    elif partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    num_partitions = -(-max_len // partition_size)
    q = query[:b].contiguous()
    # an fp8 tile is held widened to the query's dtype
    held = q.dtype if kv_format(k_cache) else k_cache.dtype
    hw_fp8 = fp8_in_hardware(k_cache, hardware_fp8)
    k_cache, v_cache, fmt = kv_cache_operands(k_cache, v_cache)
    tables = meta.block_tables[:b].contiguous()
    lens = meta.seq_lens[:b].contiguous()
    m, l, acc = partition_workspace(b, num_heads, num_partitions, head_size, q.device)
    out = torch.empty_like(q)
    partial_kernel, merge_kernel = _kernels()
    block_d = _next_power_of_2(max(head_size, 16))  # tl.dot needs 16 at least on each side
    group = num_heads // num_kv_heads
    block_g = query_heads_per_program(group, block_d)
    head_chunks = -(-group // block_g)
    window = sliding_window or NO_WINDOW
    plan = merge_plan(group, block_g, block_d, num_partitions)
    if fused_merge is not None:
        plan = replace(plan, fused=fused_merge)
    sinks_arg = m if sinks is None else sinks
    partial_kernel[(b, num_kv_heads * head_chunks, num_partitions)](
        q, k_cache, v_cache, tables, lens, m, l, acc, out, sinks_arg,
        semaphores.counters(q.device, b * num_kv_heads * head_chunks), scale, softcap or 1.0, window,
        num_heads, num_kv_heads, head_size, tables.shape[1], num_partitions, partition_size, head_chunks,
        BLOCK_SIZE=block_size, BLOCK_D=block_d, BLOCK_G=block_g,
        TILE=min(key_tile(head_size, held), partition_size),
        USE_SOFTCAP=softcap is not None, PRECISION=dot_precision(q.dtype), KV_FORMAT=fmt, HW_FP8=hw_fp8,
        FUSED_MERGE=plan.fused, MERGE_G=plan.heads, MERGE_P=plan.partitions, USE_SINKS=sinks is not None,
        # not heads wider than 256: MLA's latent queries carry the absorbed key projection,
        # whose range float16 is not known to hold (Gemma 4's 512-wide global heads too)
        HALF_DOTS=fmt != 0 and q.dtype == torch.bfloat16 and head_size <= 256,
        # a 1024-wide accumulator over 4 warps would spill, as would float32's tiles beside a fused merge
        num_warps=8 if block_d > 256 or q.dtype == torch.float32 else 4, **launch_options(q))
    if not plan.fused:
        merge_kernel[(b, num_heads)](m, l, acc, out, lens, sinks_arg, window, num_heads, head_size,
                                     num_partitions, partition_size, BLOCK_D=block_d, BLOCK_P=plan.partitions,
                                     USE_SINKS=sinks is not None, **launch_options(q))
    return out
