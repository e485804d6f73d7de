"""Pre-quantized Hugging Face checkpoints, dequantized as they load.

A folder whose config.json carries a `quantization_config` stores some linear weights as
integers or fp8 values with scales. Each such weight is rebuilt dense (float32, then the
model's dtype as it loads) from its parts; the model runs as if the checkpoint were dense,
so every op, device and feature works unchanged, and `--quantization int8` or `int4` can
shrink it again. Formats read:

- compressed-tensors (llm-compressor, RedHatAI / Neural Magic models): pack-quantized
  (int1-8 packed in int32, e.g. W4A16 GPTQ/AWQ exports), int-quantized, naive-quantized and
  float-quantized (FP8), per tensor, channel, group (with or without g_idx) or block;
- fp8 (transformers' FineGrainedFP8: Qwen3-*-FP8, DeepSeek): fp8 with 2-D block scales;
- fbgemm_fp8 (Meta's Llama 3.1 FP8): fp8 with per-channel scales;
- gptq (AutoGPTQ / GPTQModel, 2, 4 or 8 bits, v1 and v2 zero points) and awq (GEMM layout);
- mxfp4 (gpt-oss's experts: `<weight>_blocks` / `<weight>_scales`, weights/mxfp4.py), handed
  over as transformers' own modules hold them.

Activation and KV-cache scales (static W8A8, kv_cache_scheme) are dropped: activations run
in the model's dtype, and the KV cache follows --kv-cache-dtype.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Iterator

import torch

from tessera.weights.dequantize import ScaleLayout, awq_unpack, dequantize_weight, unpack_int32
from tessera.weights.lazy import materialize
from tessera.weights.mxfp4 import dequantize_mxfp4

logger = logging.getLogger(__name__)

SUPPORTED_METHODS = ("compressed-tensors", "fp8", "fbgemm_fp8", "gptq", "awq", "mxfp4")
_CT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
# activation / KV-cache quantization parameters: the model runs without them
_DROPPED = ("input_scale", "input_zero_point", "output_scale", "output_zero_point", "activation_scale",
            "input_scale_ub", "k_scale", "v_scale", "q_scale", "k_zero_point", "v_zero_point")


class QuantizedCheckpointError(ValueError):
    pass


@dataclass(frozen=True)
class WeightScheme:
    """How one group of a compressed-tensors checkpoint stores its weights."""

    format: str
    num_bits: int
    layout: ScaleLayout
    symmetric: bool


@dataclass(frozen=True)
class CheckpointQuantization:
    """A checkpoint's quantization_config, checked and read."""

    method: str
    parts: tuple[str, ...]       # tensor suffixes of one quantized weight
    markers: tuple[str, ...]     # suffixes that mark a module as quantized
    # compressed-tensors: (targets, scheme) in config order
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...] = ()
    num_bits: int = 4            # gptq / awq
    group_size: int = -1         # gptq / awq; -1: one group per output channel
    gptq_v1_zeros: bool = True   # GPTQ's v1 format stores each zero point minus one
    block: tuple[int, int] = (128, 128)  # fp8
    notes: tuple[str, ...] = field(default=())
    # how a part's name joins its module's: "<module>.weight_scale"; mxfp4's
    # "<weight>_blocks", whose dense tensor is "<weight>" itself (dense_suffix "")
    separator: str = "."
    dense_suffix: str = ".weight"

    def dequantized(self, weights: Iterable[tuple[str, Any]], names: set[str]) -> Iterator[tuple[str, Any]]:
        """`weights` with each quantized module's parts replaced by one dense `weight`;
        `names` are all tensor names of the checkpoint (to know a module's parts up front,
        in whatever order and files they come)."""
        sep = self.separator
        quantized = {name.rsplit(sep, 1)[0] for name in names if name.rsplit(sep, 1)[-1] in self.markers}
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            prefix, _, suffix = name.rpartition(sep)
            if suffix in _DROPPED:
                continue
            if prefix not in quantized or suffix not in self.parts:
                yield name, tensor
                continue
            parts = pending.setdefault(prefix, {})
            parts[suffix] = materialize(tensor)
            if all(s in parts or f"{prefix}{sep}{s}" not in names for s in self.parts):
                try:
                    dense = self.dequantize(prefix, pending.pop(prefix))
                except (ValueError, KeyError, RuntimeError) as exc:
                    raise QuantizedCheckpointError(f"{prefix}: cannot dequantize its {self.method} "
                                                   f"weight: {exc}") from exc
                yield f"{prefix}{self.dense_suffix}", dense
        if pending:
            shown = ", ".join(f"{p} ({', '.join(sorted(s))})" for p, s in list(pending.items())[:5])
            raise QuantizedCheckpointError(f"quantized weights with missing parts: {shown}")

    def dequantize(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.method == "compressed-tensors":
            return _compressed_tensors_weight(parts, self.scheme_for(module))
        if self.method == "fp8" and "weight_scale_inv" in parts:  # transformers' FineGrainedFP8
            return dequantize_weight(parts["weight"], parts["weight_scale_inv"], ScaleLayout("block", block=self.block))
        if self.method == "fp8":  # AutoFP8's per-tensor scale
            return dequantize_weight(parts["weight"], parts["weight_scale"], ScaleLayout("tensor"))
        if self.method == "fbgemm_fp8":
            return dequantize_weight(parts["weight"], parts["weight_scale"], ScaleLayout("channel"))
        if self.method == "gptq":
            return _gptq_weight(parts, self.num_bits, self.group_size, self.gptq_v1_zeros)
        if self.method == "awq":
            return _awq_weight(parts, self.group_size)
        if self.method == "mxfp4":  # [E, out, in] stored; transformers' expert modules hold [E, in, out]
            # bf16 holds every E2M1 value times any power of two exactly: half float32's memory
            return dequantize_mxfp4(parts["blocks"], parts["scales"], torch.bfloat16).transpose(-1, -2)
        raise QuantizedCheckpointError(f"no dequantizer for {self.method!r}")

    @cached_property
    def _target_owner(self) -> dict[str, WeightScheme]:
        """Each compressed-tensors target and the first group naming it (built once)."""
        owner: dict[str, WeightScheme] = {}
        for targets, scheme in self.groups:
            for target in targets:
                owner.setdefault(target, scheme)
        return owner

    def scheme_for(self, module: str) -> WeightScheme:
        """The compressed-tensors group for a module, as the library's match_targets picks it:
        an exact name first, then `re:` patterns in sorted order (re.match), then a class
        name (every quantized tensor here is a Linear's)."""
        owner = self._target_owner
        if module in owner:
            return owner[module]
        for target in sorted(t for t in owner if t.startswith("re:")):
            if re.match(target[3:], module):
                return owner[target]
        if "Linear" in owner:
            return owner["Linear"]
        raise QuantizedCheckpointError(f"{module} holds quantized weights but no config group targets it")


def _compressed_tensors_weight(parts: dict[str, torch.Tensor], scheme: WeightScheme) -> torch.Tensor:
    zero, g_idx = parts.get("weight_zero_point"), parts.get("weight_g_idx")
    packed = scheme.format == "pack-quantized"
    if packed != ("weight_packed" in parts):
        raise ValueError(f"its group's format is {scheme.format} but it stores "
                         f"{'weight_packed' if 'weight_packed' in parts else 'a plain weight'}")
    if packed:
        rows, cols = (int(d) for d in parts["weight_shape"].tolist())
        bits, offset = scheme.num_bits, 1 << (scheme.num_bits - 1)  # stored unsigned: value + offset
        quantized = unpack_int32(parts["weight_packed"], bits, cols, dim=1, exact=True) - offset
        if zero is not None and scheme.layout.strategy in ("group", "channel"):
            zero = unpack_int32(zero, bits, rows, dim=0, exact=True) - offset  # packed along rows
    else:
        quantized = parts["weight"]
    return dequantize_weight(quantized, parts["weight_scale"], scheme.layout,
                             None if scheme.symmetric else zero, g_idx)


def _gptq_weight(parts: dict[str, torch.Tensor], bits: int, group_size: int, v1_zeros: bool) -> torch.Tensor:
    qweight, scales = parts["qweight"], parts["scales"]       # [in / (32/bits), out], [groups, out]
    cols, rows = qweight.shape[0] * 32 // bits, qweight.shape[1]
    # the words transposed first (an eighth of the weight's size at 4 bits), so the values
    # unpack along rows, already [out, in]
    quantized = unpack_int32(qweight.T.contiguous(), bits, cols, dim=1)
    qzeros = parts["qzeros"]
    if v1_zeros:
        # stored minus one, taken from the whole word (GPTQModel's writer: a zero of 0 borrows
        # from its neighbour), so add one per slot back to the whole word, as its reader does
        ones = sum(1 << (bits * k) for k in range(32 // bits))
        words = (qzeros.to(torch.int64) + ones) & 0xFFFFFFFF
        qzeros = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    zeros = unpack_int32(qzeros, bits, rows, dim=1).T
    layout = ScaleLayout("group", group_size=group_size if group_size > 0 else cols)
    return dequantize_weight(quantized, scales.T, layout, zeros, parts.get("g_idx"))


def _awq_weight(parts: dict[str, torch.Tensor], group_size: int) -> torch.Tensor:
    qweight, scales = parts["qweight"], parts["scales"]       # [in, out / 8], [groups, out]
    rows, cols = scales.shape[1], qweight.shape[0]
    size = group_size if group_size > 0 else cols
    zeros = awq_unpack(parts["qzeros"], rows)                  # [groups, out]
    if cols % size or scales.shape != (cols // size, rows) or zeros.shape != scales.shape:
        raise ValueError(f"AWQ scales {tuple(scales.shape)} / zeros {tuple(zeros.shape)} do not cover a "
                         f"[{rows}, {cols}] weight in groups of {size}")
    # dequantized as stored, [in, out] (input rows grouped), and handed over transposed
    weight = awq_unpack(qweight, rows).to(torch.float32)
    grouped = weight.view(cols // size, size, rows)
    grouped -= zeros.to(torch.float32).unsqueeze(1)
    grouped *= scales.to(torch.float32).unsqueeze(1)
    return weight.T


def checkpoint_quantization(config: Any) -> CheckpointQuantization | None:
    """The model config's `quantization_config`, read; None for a dense checkpoint. Raises
    QuantizedCheckpointError, saying why, for what cannot be loaded."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "fp8":  # 2-D block scales (weight_scale_inv), or AutoFP8's per-tensor weight_scale
        block = qc.get("weight_block_size")
        if block is not None and len(block) != 2:
            raise QuantizedCheckpointError(f"fp8 checkpoints with weight_block_size {block!r} are not "
                                           "supported (2-D blocks, e.g. [128, 128])")
        return CheckpointQuantization("fp8", ("weight", "weight_scale_inv", "weight_scale"),
                                      ("weight_scale_inv", "weight_scale"),
                                      block=(int(block[0]), int(block[1])) if block else (0, 0))
    if method == "fbgemm_fp8":
        return CheckpointQuantization("fbgemm_fp8", ("weight", "weight_scale"), ("weight_scale",))
    if method in ("gptq", "awq"):
        return _gptq_awq(method, qc)
    if method == "mxfp4":
        return CheckpointQuantization("mxfp4", ("blocks", "scales"), ("blocks",), separator="_", dense_suffix="")
    raise QuantizedCheckpointError(
        f"quantization method {method!r} is not supported; tessera dequantizes checkpoints of "
        f"{', '.join(SUPPORTED_METHODS)} as they load (or load a dense checkpoint, optionally "
        "with --quantization int8 or int4)")


def _gptq_awq(method: str, qc: dict) -> CheckpointQuantization:
    bits, group_size = int(qc.get("bits", qc.get("w_bit", 4))), int(qc.get("group_size", qc.get("q_group_size", -1)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or bits != 4:
            raise QuantizedCheckpointError(f"AWQ checkpoints are read in the 4-bit GEMM layout; this one "
                                           f"is {bits}-bit {version!r}")
        if not qc.get("zero_point", True):
            raise QuantizedCheckpointError("AWQ checkpoints without zero points are not supported")
        return CheckpointQuantization("awq", ("qweight", "qzeros", "scales"), ("qweight",),
                                      num_bits=4, group_size=group_size)
    if bits not in (2, 4, 8):
        raise QuantizedCheckpointError(f"GPTQ checkpoints of {bits} bits are not supported (2, 4 or 8)")
    declared = {qc[key] for key in ("format", "checkpoint_format") if qc.get(key)}  # GPTQModel writes both
    if len(declared) > 1:
        raise QuantizedCheckpointError(f"GPTQ config declares two formats: {sorted(declared)}")
    fmt = declared.pop() if declared else "gptq"
    if fmt not in ("gptq", "gptq_v2") or qc.get("is_marlin_format"):
        raise QuantizedCheckpointError(f"GPTQ format {'marlin' if qc.get('is_marlin_format') else fmt!r} "
                                       "is not supported (gptq or gptq_v2)")
    if qc.get("dynamic"):
        raise QuantizedCheckpointError("GPTQ per-module overrides (`dynamic`) are not supported")
    if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise QuantizedCheckpointError(f"GPTQ pack_dtype {qc['pack_dtype']!r} is not supported (int32)")
    return CheckpointQuantization("gptq", ("qweight", "qzeros", "scales", "g_idx"), ("qweight",),
                                  num_bits=bits, group_size=group_size, gptq_v1_zeros=fmt == "gptq")


def _compressed_tensors(qc: dict) -> CheckpointQuantization:
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise QuantizedCheckpointError("sparse compressed-tensors checkpoints are not supported")
    if qc.get("transform_config"):
        raise QuantizedCheckpointError("transformed (rotated) compressed-tensors checkpoints are not supported")
    status = qc.get("quantization_status", "compressed")
    if status not in ("compressed", "frozen"):
        raise QuantizedCheckpointError(f"compressed-tensors quantization_status {status!r} is not supported")
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights")
        if not weights:
            continue  # activation-only quantization: the weights are dense
        fmt = group.get("format") or qc.get("format")
        groups.append((tuple(group.get("targets") or ()), _ct_scheme(name, fmt, weights)))
    notes = ("its KV-cache scales are ignored (see --kv-cache-dtype)",) if qc.get("kv_cache_scheme") else ()
    return CheckpointQuantization(
        "compressed-tensors", ("weight", "weight_packed", "weight_shape", "weight_scale", "weight_zero_point",
                               "weight_g_idx"),
        ("weight_packed", "weight_scale"), groups=tuple(groups), notes=notes)


def _ct_scheme(name: str, fmt: str | None, args: dict) -> WeightScheme:
    bits, kind = int(args.get("num_bits", 8)), args.get("type", "int")
    group_size = int(args.get("group_size") or 0)
    strategy = args.get("strategy") or ("group" if group_size > 0 else "channel" if group_size == -1 else "tensor")
    where = f"compressed-tensors group {name!r}"
    if fmt not in _CT_FORMATS:
        raise QuantizedCheckpointError(f"{where}: format {fmt!r} is not supported ({', '.join(_CT_FORMATS)})")
    if kind == "float" and bits != 8:
        raise QuantizedCheckpointError(f"{where}: {bits}-bit floats (e.g. NVFP4, MXFP4) are not supported")
    if kind not in ("int", "float") or not 1 <= bits <= 8:
        raise QuantizedCheckpointError(f"{where}: {bits}-bit {kind!r} weights are not supported")
    if strategy not in ("tensor", "channel", "group", "block"):
        raise QuantizedCheckpointError(f"{where}: strategy {strategy!r} is not supported")
    block = tuple(args.get("block_structure") or (0, 0))
    layout = ScaleLayout(strategy, group_size=max(group_size, 0), block=(int(block[0]), int(block[1])))
    return WeightScheme(fmt, bits, layout, bool(args.get("symmetric", True)))
