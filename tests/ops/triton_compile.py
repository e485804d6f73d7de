"""Compile the Triton kernels for NVIDIA GPUs on a machine without one.

The interpreter (tests/ops/triton_cases.py) checks what the kernels compute, not that they
compile: Triton's type rules, tl.dot's shape limits, shared memory and registers only show
up in a real compile. Triton compiles to PTX and a cubin (its bundled ptxas) for any target
without a driver, so each kernel wrapper runs here at real model shapes with its kernels
swapped for a recorder that compiles what a launch would (the same signature,
specializations and constexprs) instead of launching it. ptxas -v then gives registers and
spills.

`python -m tests.ops.triton_compile` prints the table; test_triton_compile.py asserts on it.
"""
from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tessera.ops.attention.metadata import AttentionMetadata

# bytes of shared memory one block may use (the opt-in maximum per SM generation)
SHARED_LIMIT = {80: 166912, 90: 232448}


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_size: int
    hidden: int
    intermediate: int
    softcap: float | None = None
    window: int | None = None
    sinks: bool = False


SHAPES = (
    Shape("llama-3-8b", 32, 8, 128, 4096, 14336),
    Shape("smollm2-135m", 9, 3, 64, 576, 1536),
    Shape("qwen2-7b", 28, 4, 128, 3584, 18944),
    Shape("phi-3-mini", 32, 32, 96, 3072, 8192),
    Shape("gemma-2-9b", 16, 8, 256, 3584, 14336, softcap=50.0, window=4096),
    Shape("mqa-64", 64, 1, 128, 8192, 28672),
    # gpt-oss-20b: attention sinks, a 128-token window; DeepSeek-V3's MLA: 128 query heads over
    # one 576-wide latent KV head (its split over programs, its narrow prefill tiles)
    Shape("gpt-oss-20b", 64, 8, 64, 2880, 2880, window=128, sinks=True),
    Shape("deepseek-v3-mla", 128, 1, 576, 7168, 2048),
    # Gemma 4's full-attention layers: 512-wide heads over few KV heads, scale 1 (the kernels
    # take the scale as an argument; the head size is what changes their tiles)
    Shape("gemma-4-full", 32, 4, 512, 5376, 21504),
)


@dataclass
class Compiled:
    kernel: str
    case: str
    shared: int
    registers: int
    spilled: int  # bytes of spill stores + loads
    fp8_conversions: int  # the GPU's fp8 -> f16 conversions in the PTX (cvt ... e4m3x2 / e5m2x2)
    matrix_ops: str = ""   # the PTX's matrix instructions: "wgmma" (Hopper), "mma.sync", or none
    async_copies: int = 0  # cp.async loads in the PTX: a pipelined global -> shared stream
    fused_multiply_adds: int = 0  # fma.rn.f32 in the PTX: a product and a sum rounded once
    # acquire-release atomics at GPU scope (semaphores.py: the last program to arrive
    # finishes), each after a CTA barrier in the PTX
    ordered_arrivals: int = 0
    # griddepcontrol.wait in the PTX: a kernel launched with PDL waits for the one before
    pdl_waits: int = 0
    # L2 prefetch hints in the PTX ahead of its first griddepcontrol.wait (prefetch.py)
    prefetches_before_wait: int = 0
    # float16 -> bf16 conversions (cvt.bf16.f16): an fp8 tile, widened to float16, on to bf16
    half_to_bf16: int = 0


def _ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        log = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", str(src), "-o",
                              str(Path(tmp) / "k.cubin")], capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spilled = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return registers, spilled


def _ordered_arrivals(ptx: str) -> int:
    """Acquire-release atomic adds at GPU scope with a CTA barrier between them and the
    last global store before them: every thread's stores are ordered before the arrival."""
    count = 0
    for atom in re.finditer(r"\batom\.global\.gpu\.acq_rel\.add", ptx):
        before = ptx[:atom.start()]
        if before.rfind("bar.sync") > before.rfind("st.global"):
            count += 1
    return count


def _prefetches_before_wait(ptx: str) -> int:
    wait = ptx.find("griddepcontrol.wait")
    return len(re.findall(r"prefetch\.global\.L2", ptx[:wait])) if wait >= 0 else 0


class _Recorder:
    """Stands in for a JITFunction: `rec[grid](*args, **kw)` compiles for `arch`."""

    def __init__(self, fn, arch: int, case: str, out: list[Compiled]):
        self.fn, self.arch, self.case, self.out = fn, arch, case, out

    def __getitem__(self, grid):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile, make_backend
        from triton.runtime.jit import create_function_from_signature

        def launch(*args, **kwargs):
            target = GPUTarget("cuda", self.arch, 32)
            backend = make_backend(target)
            fn = self.fn
            bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
            kernel = compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
            ptx = kernel.asm["ptx"]
            registers, spilled = _ptxas_report(ptx, self.arch)
            conversions = len(re.findall(r"cvt\.rn\.f16x2\.e(?:4m3|5m2)x2", ptx))
            matrix = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else ""
            self.out.append(Compiled(fn.__name__, self.case, kernel.metadata.shared, registers, spilled,
                                     conversions, matrix, len(re.findall(r"cp\.async\.c[ag]", ptx)),
                                     len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
                                     _ordered_arrivals(ptx), len(re.findall(r"griddepcontrol\.wait", ptx)),
                                     _prefetches_before_wait(ptx), len(re.findall(r"cvt\.(?:rn\.)?bf16\.f16\b", ptx))))

        return launch


def _meta(num_decodes: int, lens: list[int], q_lens: list[int], block_size: int) -> AttentionMetadata:
    width = -(-max(lens) // block_size)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
        block_tables=torch.zeros((len(lens), width), dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        num_decodes=num_decodes, num_decode_tokens=num_decodes,
        seq_lens_list=list(lens), query_lens_list=list(q_lens))


def compile_all(arch: int, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
                shapes: tuple[Shape, ...] = SHAPES, block_size: int = 16,
                kv_dtype: torch.dtype | None = None, hardware_fp8: bool | None = None,
                pdl: bool = False) -> list[Compiled]:
    """Every kernel wrapper at every shape and dtype, as the engine calls them: decode at
    batch 1 over 8k tokens and batch 64 over 2k, a prefill chunk over a cached prefix.
    `kv_dtype`: an 8-bit float KV cache (None: the model dtype), widened by the GPU's fp8
    conversions where `arch` has them (sm_89+) unless `hardware_fp8` says otherwise.
    `pdl`: launched with programmatic dependent launch (tessera/ops/triton/launch.py)."""
    hardware_fp8 = arch >= 89 if hardware_fp8 is None else hardware_fp8
    import tessera.ops.triton.activation as activation
    import tessera.ops.triton.launch as launch
    import tessera.ops.triton.kv_write as kv_write
    import tessera.ops.triton.paged_decode as paged_decode
    import tessera.ops.triton.paged_prefill as paged_prefill
    import tessera.ops.triton.rms_norm as rms_norm
    import tessera.ops.triton.rotary as rotary
    import tessera.ops.triton.rotary_kv_write as rotary_kv_write

    out: list[Compiled] = []
    single = (kv_write, paged_prefill, rms_norm, activation, rotary, rotary_kv_write)  # modules with one _kernel
    originals = [m._kernel for m in single]
    original_decode, original_enabled = paged_decode._kernels, launch._enabled
    launch._enabled = lambda device: pdl
    try:
        for dtype in dtypes:
            for shape in shapes:
                case = f"{shape.name} {str(dtype).removeprefix('torch.')} sm_{arch}"
                if kv_dtype is not None:
                    case += f" kv {str(kv_dtype).removeprefix('torch.')}"
                for module, original in zip(single, originals):
                    module._kernel = lambda original=original, case=case: _Recorder(original(), arch, case, out)
                paged_decode._kernels = lambda case=case: tuple(_Recorder(k, arch, case, out)
                                                                for k in original_decode())
                h, hk, d = shape.heads, shape.kv_heads, shape.head_size
                x = torch.zeros((2, shape.hidden), dtype=dtype)
                rms_norm.triton_rms_norm(x, x[0], 1e-6, x)
                gate_up = torch.zeros((2, 2 * shape.intermediate), dtype=dtype)
                (activation.triton_gelu_tanh_and_mul if shape.softcap else activation.triton_silu_and_mul)(gate_up)
                qkv = torch.zeros((2, (h + 2 * hk) * d), dtype=dtype)
                cos_sin = torch.zeros((2, 1, 2 * d), dtype=dtype)
                rotary.triton_rotary(qkv[:, :h * d], qkv[:, h * d:(h + hk) * d], cos_sin[..., :d], cos_sin[..., d:], d)
                sinks = torch.zeros(h) if shape.sinks else None
                k_cache = torch.zeros((4, block_size, hk, d), dtype=kv_dtype or dtype)
                v_cache = torch.zeros_like(k_cache)
                rows = torch.zeros((3, hk, d), dtype=dtype)
                kv_write.triton_kv_write(rows, rows, k_cache, v_cache, torch.zeros(3, dtype=torch.int64))
                rotary_kv_write.triton_rotary_kv_write(qkv[:, :h * d], qkv[:, h * d:(h + hk) * d], qkv[:, (h + hk) * d:],
                                                       cos_sin[..., :d], cos_sin[..., d:], d, k_cache, v_cache,
                                                       torch.zeros(2, dtype=torch.int64))
                # batch 64 also as merge_kernel merges it (merge_plan fuses the merge here)
                for batch, length, fused in ((1, 8192, None), (64, 2048, None), (64, 2048, False)):
                    meta = _meta(batch, [length] * batch, [1] * batch, block_size)
                    paged_decode.triton_paged_decode(torch.zeros((batch, h, d), dtype=dtype), k_cache,
                                                     v_cache, meta, d ** -0.5, shape.window, shape.softcap,
                                                     sinks, hardware_fp8=hardware_fp8, fused_merge=fused)
                meta = _meta(1, [300, 1000], [1, 512], block_size)
                paged_prefill.triton_paged_prefill(torch.zeros((512, h, d), dtype=dtype), None, None, k_cache,
                                                   v_cache, meta, d ** -0.5, shape.window, shape.softcap,
                                                   sinks, hardware_fp8=hardware_fp8)
    finally:
        for module, original in zip(single, originals):
            module._kernel = original
        paged_decode._kernels, launch._enabled = original_decode, original_enabled
    return out


def compile_skinny(arch: int, shape: Shape, num_sms: int = 132,
                   dtype: torch.dtype = torch.bfloat16, pdl: bool = False) -> list[Compiled]:
    """Every candidate the few-row linear times (tessera/ops/triton/skinny_linear.py) at
    the shape's four projections (QKV, o, gate-up, down, and down applying SiLU-and-mul to
    its gate-up input; QKV and gate-up normalising theirs with the residual added), one
    row, on `num_sms` SMs."""
    import tessera.ops.triton.launch as launch
    import tessera.ops.triton.skinny_linear as skinny

    out: list[Compiled] = []
    original, original_enabled = skinny._kernel, launch._enabled
    launch._enabled = lambda device: pdl
    h, hk, d = shape.heads, shape.kv_heads, shape.head_size
    layers = {"qkv": ((h + 2 * hk) * d, shape.hidden), "o": (shape.hidden, h * d),
              "gate_up": (2 * shape.intermediate, shape.hidden), "down": (shape.hidden, shape.intermediate),
              "down_gated": (shape.hidden, shape.intermediate),  # SiLU-and-mul applied while loading
              "qkv_normed": ((h + 2 * hk) * d, shape.hidden),  # the input RMSNorm applied while loading
              "gate_up_normed": (2 * shape.intermediate, shape.hidden)}
    try:
        for layer, (n, k) in layers.items():
            gated = layer == "down_gated"
            rows = torch.zeros((1, k), dtype=dtype)
            norm = skinny.InputNorm(rows[0], 1e-6, rows, torch.zeros_like(rows)) if "normed" in layer else None
            for config in skinny.candidate_configs(n, k, num_sms):
                case = f"{shape.name} {layer} {config.name} sm_{arch}"
                skinny._kernel = lambda case=case: _Recorder(original(), arch, case, out)
                skinny.skinny_linear(torch.zeros((1, 2 * k if gated else k), dtype=dtype),
                                     torch.zeros((n, k), dtype=dtype), None, config,
                                     "silu_and_mul" if gated else None, norm)
    finally:
        skinny._kernel, launch._enabled = original, original_enabled
    return out


class _KeyRecorder:
    """Stands in for a JITFunction: records the key Triton would compile a launch under
    (signature, specialisations, constexprs), compiling nothing."""

    def __init__(self, fn, keys: dict[str, set[str]]):
        self.fn, self.keys = fn, keys

    def __getitem__(self, grid):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        def launch(*args, **kwargs):
            backend = make_backend(GPUTarget("cuda", 90, 32))
            fn = self.fn
            bound, spec, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
            _, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
            self.keys.setdefault(fn.__name__, set()).add(repr((signature, constexprs, attrs)))

        return launch


def attention_variants(shape: Shape = SHAPES[0], block_size: int = 16,
                       kv_dtype: torch.dtype | None = None) -> dict[str, int]:
    """How many compiles the attention kernels need over eager serving steps of one model:
    decode batches of 1-64 at lengths up to 4k, prefill chunks after 0-17 decodes.
    `kv_dtype`: an 8-bit float KV cache (None: the model dtype, bf16)."""
    import tessera.ops.triton.paged_decode as paged_decode
    import tessera.ops.triton.paged_prefill as paged_prefill

    keys: dict[str, set[str]] = {}
    original_decode, original_prefill = paged_decode._kernels, paged_prefill._kernel
    paged_decode._kernels = lambda: tuple(_KeyRecorder(k, keys) for k in original_decode())
    paged_prefill._kernel = lambda: _KeyRecorder(original_prefill(), keys)
    h, hk, d = shape.heads, shape.kv_heads, shape.head_size
    k_cache = torch.zeros((4, block_size, hk, d), dtype=kv_dtype or torch.bfloat16)
    try:
        for batch in (1, 2, 3, 8, 16, 17, 64):
            for length in range(1, 4096, 61):
                meta = _meta(batch, [length] * batch, [1] * batch, block_size)
                paged_decode.triton_paged_decode(torch.zeros((batch, h, d), dtype=torch.bfloat16), k_cache,
                                                 k_cache, meta, d ** -0.5, shape.window, shape.softcap)
        for decodes in (0, 1, 2, 16, 17):
            for q_len, ctx in ((5, 5), (16, 49), (100, 100), (512, 672)):
                meta = _meta(decodes, [50] * decodes + [ctx], [1] * decodes + [q_len], block_size)
                paged_prefill.triton_paged_prefill(torch.zeros((q_len, h, d), dtype=torch.bfloat16), None, None,
                                                   k_cache, k_cache, meta, d ** -0.5, shape.window, shape.softcap)
    finally:
        paged_decode._kernels, paged_prefill._kernel = original_decode, original_prefill
    return {name: len(found) for name, found in keys.items()}


if __name__ == "__main__":
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    results = compile_all(arch, (torch.bfloat16, torch.float16, torch.float32))
    results += compile_all(arch, (torch.bfloat16, torch.float32), kv_dtype=torch.float8_e4m3fn)
    print(f"{'kernel':<16} {'case':<50} {'shared':>8} {'regs':>5} {'spill':>6}")
    for r in results:
        print(f"{r.kernel:<16} {r.case:<50} {r.shared:>8} {r.registers:>5} {r.spilled:>6}")


def compile_mxfp4(arch: int, dtype: torch.dtype = torch.bfloat16) -> list[Compiled]:
    """The MXFP4 expert linear (tessera/ops/triton/mxfp4_linear.py) at gpt-oss-20b's two
    projections (gate-up 5760 x 2880, down 2880 x 2880), for a decode (1 row) and a prefill
    tile (64 rows), with a bias."""
    import tessera.ops.triton.mxfp4_linear as mxfp4

    out: list[Compiled] = []
    original = mxfp4._kernel
    try:
        for name, (n, k) in {"gate_up": (5760, 2880), "down": (2880, 2880)}.items():
            for rows in (1, 64):
                case = f"gpt-oss-20b {name} {rows} rows sm_{arch}"
                mxfp4._kernel = lambda case=case: _Recorder(original(), arch, case, out)
                mxfp4.mxfp4_linear(torch.zeros((rows, k), dtype=dtype), torch.zeros((n, k // 32, 16), dtype=torch.uint8),
                                   torch.zeros((n, k // 32), dtype=torch.uint8), torch.zeros(n, dtype=dtype))
    finally:
        mxfp4._kernel = original
    return out


def compile_linear_attention(arch: int, dtype: torch.dtype = torch.bfloat16) -> list[Compiled]:
    """Qwen3.5's Gated DeltaNet kernels (tessera/ops/triton/causal_conv1d.py, gated_delta.py)
    at its real shapes: 16 key and 32 value heads of 128, conv channels 2 * 16 * 128 + 32 *
    128 over K = 4; decode at batch 64, prefill over three chunks; q/k/v are views of the
    conv output and the conv input a view of the projection's rows, as the layer passes them."""
    import tessera.ops.triton.causal_conv1d as conv
    import tessera.ops.triton.gated_delta as rule

    hk, hv, d, width = 16, 32, 128, 4
    channels = 2 * hk * d + hv * d
    out: list[Compiled] = []
    original_conv, original_rule = conv._kernels, rule._kernel
    conv_state = torch.zeros((64, channels, width - 1), dtype=dtype)
    state = torch.zeros((64, hv, d, d), dtype=torch.float32)
    weight = torch.zeros((channels, width), dtype=dtype)
    try:
        for phase, rows in (("decode", 64), ("prefill", 700)):
            case = f"qwen3.5 {phase} {str(dtype).removeprefix('torch.')} sm_{arch}"
            conv._kernels = lambda case=case: tuple(_Recorder(k, arch, case, out) for k in original_conv())
            rule._kernel = lambda case=case: _Recorder(original_rule(), arch, case, out)
            mixed = torch.zeros((rows, channels + hv * d), dtype=dtype)[:, :channels]  # [qkv | z] rows
            g, beta = torch.zeros((rows, hv)), torch.zeros((rows, hv))
            q, k, v = torch.zeros((rows, channels), dtype=dtype).split([hk * d, hk * d, hv * d], dim=-1)
            q, k, v = q.reshape(rows, hk, d), k.reshape(rows, hk, d), v.reshape(rows, hv, d)
            if phase == "decode":
                slots = torch.arange(rows)
                conv.triton_causal_conv1d_decode(mixed, weight, None, conv_state, slots)
                rule.triton_gated_delta_decode(q, k, v, g, beta, state, slots)
            else:
                lists = ([5, 9, 2], [3, 600, 97], [False, True, True])
                conv.triton_causal_conv1d_prefill(mixed, weight, None, conv_state, *lists)
                rule.triton_gated_delta_prefill(q, k, v, g, beta, state, *lists)
    finally:
        conv._kernels, rule._kernel = original_conv, original_rule
    return out


def compile_ssm_scan(arch: int, dtype: torch.dtype = torch.bfloat16) -> list[Compiled]:
    """Mamba-2's scan (tessera/ops/triton/ssm_scan.py) at Granite 4.0-H-like shapes: 128
    heads of 64, one group, d_state 128; decode at batch 64, prefill over three chunks; x, B
    and C are views of the conv output's rows and dt a column slice of the projection's, as
    Mamba2Scan passes them."""
    import tessera.ops.triton.ssm_scan as scan

    heads, head_dim, groups, size = 128, 64, 1, 128
    inner = heads * head_dim
    out: list[Compiled] = []
    original = scan._kernel
    state = torch.zeros((64, heads, head_dim, size), dtype=torch.float32)
    per_head = torch.zeros(heads, dtype=dtype)
    A = torch.zeros(heads)
    try:
        for phase, rows in (("decode", 64), ("prefill", 700)):
            case = f"granite-4.0-h {phase} {str(dtype).removeprefix('torch.')} sm_{arch}"
            scan._kernel = lambda case=case: _Recorder(original(), arch, case, out)
            conv = torch.zeros((rows, inner + 2 * groups * size), dtype=dtype)
            x, B, C = conv.split([inner, groups * size, groups * size], dim=-1)
            x, B, C = x.reshape(rows, heads, head_dim), B.reshape(rows, groups, size), C.reshape(rows, groups, size)
            dt = torch.zeros((rows, 2 * inner + 2 * groups * size + heads), dtype=dtype)[:, -heads:]  # [z|xBC|dt]
            args = (x, dt, per_head, A, B, C, per_head, (0.0, float("inf")), state)
            if phase == "decode":
                scan.triton_ssm_scan_decode(*args, torch.arange(rows))
            else:
                scan.triton_ssm_scan_prefill(*args, [5, 9, 2], [3, 600, 97], [False, True, True])
    finally:
        scan._kernel = original
    return out
