"""8-bit float KV cache values in Triton (tessera/ops/attention/kv_quant.py): fp8 bytes <->
float32 with integer ops and bitcasts only, so no fp8 hardware type is needed (any GPU, and
the interpreter). Where the GPU converts fp8 itself (sm_89+: Ada, Hopper), load_kv's HW_FP8
widens with its instructions instead: on an H100 the integer decoding (~10 operations an
element) made fp8-cache decode slower than bf16's, which reads twice the bytes
(docs/benchmarks.md, session 15). The integer path is tessera/ops/cpu/fp8.h's algorithm, for
a constexpr format code FMT (kv_quant.FP8_FORMATS): 1 = e4m3fn (bias 7, 3 mantissa bits,
largest 448), 2 = e5m2 (bias 15, 2 bits, largest 57344). No step relies on float
denormals, which a GPU may flush: fp8 subnormals are whole multiples of a step, made from or
counted as integers.

Imports triton: only the kernel factories import this module (when a kernel is first
built), so CPU installs never need triton. The kernels reach it as a module global (`fp8`),
not through the factory's closure, which Triton's interpreter does not see: it runs a
kernel's source against its module's globals alone.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp8_to_f32(byte, FMT: tl.constexpr, KEEP_SPECIAL: tl.constexpr):
    """fp8 codes (uint8, any shape) -> float32, exactly. Masked loads with other=0 give 0.0.
    Without KEEP_SPECIAL, inf and NaN codes read as large finite values (the decode
    kernel's keys, whose registers are tight on sm_90; the row's values keep NaN)."""
    MANT: tl.constexpr = 3 if FMT == 1 else 2
    BIAS: tl.constexpr = 7 if FMT == 1 else 15
    STEP: tl.constexpr = 0.001953125 if FMT == 1 else 0.0000152587890625  # 2^(1 - bias - mant)
    x = byte.to(tl.int32)
    mag = x & 0x7F
    # normal: exponent and mantissa shifted into float32's places, the exponent rebased
    normal_bits = (mag << (23 - MANT)) + ((127 - BIAS) << 23)
    if KEEP_SPECIAL:
        # not finite (e4m3fn's NaN 0x7f; e5m2's inf 0x7c and NaNs, as float16's): float32's
        # all-ones exponent over the same mantissa, by arithmetic rather than a select
        SPECIAL: tl.constexpr = 0x7F if FMT == 1 else 0x7C
        normal_bits = normal_bits | (((mag + (128 - SPECIAL)) >> 7) * 0x7F800000)
    normal = normal_bits.to(tl.float32, bitcast=True)
    # subnormal (or zero): a whole number of steps, exact as an integer times the step
    small = mag.to(tl.float32) * STEP
    f = tl.where(mag < (1 << MANT), small, normal)
    return (f.to(tl.int32, bitcast=True) | ((x & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_fp8(x, FMT: tl.constexpr):
    """float32 -> fp8 codes (uint8): nearest, ties to even, saturating at the largest finite
    value (inf included); NaN stays NaN. Bit for bit what kv_quant.quantize_kv stores."""
    MANT: tl.constexpr = 3 if FMT == 1 else 2
    BIAS: tl.constexpr = 7 if FMT == 1 else 15
    MAX_CODE: tl.constexpr = 0x7E if FMT == 1 else 0x7B
    SHIFT: tl.constexpr = 23 - MANT
    # step * 2^23: adding it to |x| < 2^mant steps rounds |x| to whole steps (its ulp is
    # the step), nearest even, and leaves the count of steps in its low mantissa bits
    ROUNDER: tl.constexpr = 16384.0 if FMT == 1 else 128.0
    ROUNDER_BITS: tl.constexpr = (127 + 24 - BIAS - MANT) << 23
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # normal: round the dropped bits to nearest even on the integer, rebase the exponent;
    # inf (and NaN, replaced below) capped first so the sum cannot overflow
    a_cap = tl.minimum(a, 0x7F800000)
    rounded = (a_cap + ((1 << (SHIFT - 1)) - 1) + ((a_cap >> SHIFT) & 1)) >> SHIFT
    code = tl.minimum(rounded - ((127 - BIAS) << MANT), MAX_CODE)
    # below the smallest normal: a round up to 2^mant steps is the smallest normal's code
    small = (a.to(tl.float32, bitcast=True) + ROUNDER).to(tl.int32, bitcast=True) - ROUNDER_BITS
    code = tl.where(a < ((128 - BIAS) << 23), small, code)
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return (sign | code).to(tl.uint8)


@triton.jit
def load_kv(ptrs, mask, like, KV_FORMAT: tl.constexpr, KEEP_SPECIAL: tl.constexpr,
            HW_FP8: tl.constexpr):
    """Cached K or V values at `ptrs`: as stored (KV_FORMAT 0, the model dtype) or fp8
    bytes widened to `like`'s dtype (the query's, for tl.dot). Masked lanes are 0.
    KEEP_SPECIAL: see fp8_to_f32. HW_FP8: the GPU's own conversion for e4m3fn (finite codes
    exactly the same; NaN kept on a GPU, read as 480 by the interpreter). e5m2 is float16's
    top byte, widened through float16 by a shift (every code exact, inf and NaN kept):
    Triton's e5m2 -> bf16 conversion scales the bits and reads inf and NaN as finite."""
    if KV_FORMAT == 0:
        return tl.load(ptrs, mask=mask, other=0.0)
    elif HW_FP8:
        raw = tl.load(ptrs, mask=mask, other=0)
        if KV_FORMAT == 1:
            return raw.to(tl.float8e4nv, bitcast=True).to(like.dtype)
        else:
            return (raw.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(like.dtype)
    else:
        return fp8_to_f32(tl.load(ptrs, mask=mask, other=0), KV_FORMAT, KEEP_SPECIAL).to(like.dtype)


@triton.jit
def store_kv(ptrs, values, mask, KV_FORMAT: tl.constexpr):
    """K or V values into the cache at `ptrs`: as they are (KV_FORMAT 0, the model dtype)
    or rounded from float32 to fp8 bytes."""
    if KV_FORMAT == 0:
        tl.store(ptrs, values, mask=mask)
    else:
        tl.store(ptrs, f32_to_fp8(values.to(tl.float32), KV_FORMAT), mask=mask)
