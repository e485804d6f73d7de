"""`tessera inspect`: what the engine would run for a model, without generating anything.

Resolves the router, builds the model on CPU (weights loaded unless asked not to) and
reports the op registry's choice for every lookup the model made, with the reasons each
other candidate was passed over. Everything comes from the router and the registry; no
model type is named here.
"""
from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from tessera.config import ModelConfig
from tessera.models.base import BaseRouter
from tessera.models.llama.modeling import head_dim_of
from tessera.models.registry import get_router, router_classes
from tessera.ops import registry
from tessera.ops.attention import Attention
from tessera.ops.attention.kv_quant import kv_cache_torch_dtype
from tessera.ops.linear_attention import RecurrentLayer
from tessera.ops.cpu.build import isa_description, unavailable_reason
from tessera.ops.cpu.linear import AMX_KERNEL_MIN_ROWS, amx_kernel_ready, has_amx
from tessera.ops.registry import OpChoice, OpTarget
from tessera.platform import cpu_bf16_reason, resolve_weights
from tessera.pooling.model import as_pooling_model


def model_table() -> list[dict[str, Any]]:
    """One row per native model type: its router, model class and claimed features."""
    rows = []
    for model_type, router in sorted(router_classes().items()):
        rows.append({"model_type": model_type, "router": router.__name__,
                     "model_class": router.model_cls.__name__, "generates": router.generates, **router.features()})
    return rows


def dtype_reason(name: str, device: str, tessera_ops: bool = True, quantization: str | None = None) -> str:
    """Why resolve_dtype picks what it picks (mirrors tessera.platform.resolve_dtype)."""
    if name != "auto":
        return f"--dtype {name}"
    if device.startswith("cuda"):
        return "auto: bfloat16 on CUDA"
    reason = cpu_bf16_reason(tessera_ops, quantization)
    if reason:
        return f"auto: {reason}"
    return "auto: float32 (this CPU has no native bf16 and tessera's bf16 kernels do not run " \
           "for this model here; emulated bf16 is slower)"


def cpu_kernels_note(device: str) -> str | None:
    """What tessera's C kernels compute with on this CPU, or why they cannot run."""
    if torch.device(device).type != "cpu":
        return None
    reason = unavailable_reason("gemm_bf16.c")
    if reason and unavailable_reason("gemm_bf16_avx2.c") is not None:
        return f"unavailable: {reason}"
    if amx_kernel_ready():
        return f"{isa_description()}; bf16 GEMMs of {AMX_KERNEL_MIN_ROWS}+ rows on AMX tiles"
    if has_amx():
        return f"{isa_description()}; AMX here, but its kernel is unavailable: " \
               f"{unavailable_reason('gemm_packed_amx.c') or 'the OS refused its tiles'}"
    return isa_description()


@contextmanager
def _recorded_lookups() -> Iterator[list[OpChoice]]:
    """The lookups made inside the block, even those already recorded by an earlier build in
    this process (selections() lists each distinct lookup once). Saved and restored around
    the block, so the registry's record is as it would have been without inspection."""
    saved = registry.selections()
    registry._SELECTIONS.clear()
    found: list[OpChoice] = []
    try:
        yield found
    finally:
        found.extend(registry.selections())
        registry._SELECTIONS[:] = saved + [c for c in found if c not in saved]


def _spec_json(spec: registry.OpSpec) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        out[f.name] = str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else value
    return out


def _op_json(choice: OpChoice) -> dict[str, Any]:
    return {"spec": _spec_json(choice.spec), "builder": choice.builder.name,
            "priority": choice.builder.priority,
            "rejected": [{"builder": name, "reasons": list(reasons)} for name, reasons in choice.rejected],
            # select_op stops at the first fit; builders below it were never tried
            "not_tried": [b.name for b in registry.builders(choice.spec.kind)
                          if b.priority < choice.builder.priority
                          or (b.priority == choice.builder.priority and b.name != choice.builder.name
                              and b.name not in dict(choice.rejected))]}


def inspect_model(model_config: ModelConfig, *, device: str = "cpu", block_size: int = 16,
                  kv_cache_dtype: str = "auto",
                  load: bool = True) -> dict[str, Any]:
    """Everything `tessera inspect` prints, as plain data (the --json output)."""
    router: BaseRouter = get_router(model_config)
    cfg = router.config
    tessera_ops = router.implementation == "native"
    dtype, weights = resolve_weights(model_config.dtype, model_config.quantization, device, tessera_ops,
                                     router.stored_matrix_format)
    started = time.perf_counter()
    with _recorded_lookups() as lookups:
        model = router.build_model(OpTarget(torch.device(device).type, dtype,
                                            quant=weights,
                                            kv_cache_dtype=kv_cache_torch_dtype(kv_cache_dtype))).eval()
        if not router.generates:  # an encoder: its checkpoint names the backbone bare, as the engine loads it
            model = as_pooling_model(model)
    # counted as built (checkpoint shapes): after loading, builders may repack or quantize
    # weights and give a tied LM head its own copy
    num_parameters = sum(p.numel() for p in model.parameters())
    loaded = None
    if load:
        loaded = router.load_weights(model)
    build_s = time.perf_counter() - started
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    per_token = sum(a.cache_tensors * a.num_kv_heads * a.head_size * a.cache_dtype.itemsize for a in attn)
    recurrent = [m for m in model.modules() if isinstance(m, RecurrentLayer)]
    state_bytes = sum(layer.state_bytes_per_slot() for layer in recurrent)
    heads = cfg.num_attention_heads
    return {
        "source": {"kind": router.source.kind, "path": str(router.source.path), "name": router.source.name},
        "router": type(router).__name__,
        "model_type": cfg.model_type,
        "model_class": f"{type(model).__module__}.{type(model).__name__}",
        "path": router.implementation,
        "path_note": router.path_note(),
        "features": router.features(),
        "config": {
            "num_hidden_layers": cfg.num_hidden_layers, "hidden_size": cfg.hidden_size,
            "num_attention_heads": heads,
            # from the attention layers where the model has them: per layer type they may
            # differ (Gemma 4: "2/1" KV heads, head_dim "256/512")
            "num_key_value_heads": _each({a.num_kv_heads for a in attn}) or getattr(cfg, "num_key_value_heads", None)
            or heads,
            "head_dim": _each({a.head_size for a in attn}) or head_dim_of(cfg), "vocab_size": cfg.vocab_size,
            "max_model_len": router.max_model_len,
            "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
            "dtype": str(dtype).removeprefix("torch."),
            "dtype_reason": dtype_reason(model_config.dtype, device, tessera_ops,
                                         weights),
            # the linear layers' weight format (--quantization, or the one keeping the GGUF compact)
            "quantization": weights,
            "quantization_reason": (f"--quantization {model_config.quantization}" if model_config.quantization
                                    else f"auto: the GGUF stores its matrices as {router.stored_matrix_format}, "
                                    f"run in {weights}" if weights else None),
        },
        "cpu_kernels": cpu_kernels_note(device),
        # a pre-quantized checkpoint's method (weights/prequantized.py: dequantized as it loads)
        "checkpoint_quantization": quant.method if (quant := tessera_ops and router.checkpoint_quantization) else None,
        # ... unless the model keeps that method's weights packed (gpt-oss's MXFP4 experts on CPU)
        "checkpoint_packed": bool(quant and quant.method in getattr(model, "packed_checkpoint_methods", ())),
        "parameters": num_parameters,
        "weights_loaded": loaded,
        "build_seconds": round(build_s, 3),
        "ops": [_op_json(c) for c in lookups],
        "kv_cache": {"block_size": block_size, "attention_layers": len(attn),
                     "dtype": str(attn[0].cache_dtype).removeprefix("torch.") if attn else None,
                     "bytes_per_token": per_token, "bytes_per_block": per_token * block_size},
        # linear attention: a fixed-size state per running sequence, whatever its length
        "recurrent_state": {"layers": len(recurrent), "bytes_per_sequence": state_bytes} if recurrent else None,
    }


def _each(values: set[int]) -> int | str | None:
    """One value, or the layers' several as "a/b" (descending), or None for none."""
    if not values:
        return None
    return next(iter(values)) if len(values) == 1 else "/".join(map(str, sorted(values, reverse=True)))


def format_report(info: dict[str, Any]) -> str:
    """The human-readable form of inspect_model's result."""
    c, kv = info["config"], info["kv_cache"]
    src = info["source"]
    yes = [name for name, on in info["features"].items() if on]
    lines = [
        f"source:       {src['kind']} {src['path']}",
        f"router:       {info['router']} (model_type {info['model_type']!r})",
        f"model class:  {info['model_class']}",
        f"path:         {info['path_note']}",
        f"features:     {', '.join(yes) or 'none'}",
        f"config:       {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"{c['num_attention_heads']} heads / {c['num_key_value_heads']} kv heads, head_dim "
        f"{c['head_dim']}, vocab {c['vocab_size']}, max_model_len {c['max_model_len']}"
        f"{', tied embeddings' if c['tie_word_embeddings'] else ''}",
        f"dtype:        {c['dtype']} ({c['dtype_reason']})",
        *([f"weights:      {c['quantization']} ({c['quantization_reason']})"] if c.get("quantization") else []),
        *([f"cpu kernels:  {info['cpu_kernels']}"] if info.get("cpu_kernels") else []),
        *([f"checkpoint:   {info['checkpoint_quantization']}-quantized, "
           + ("kept packed" if info.get("checkpoint_packed") else "dequantized as it loads")]
          if info.get("checkpoint_quantization") else []),
        f"parameters:   {info['parameters']:,}"
        + (f" ({info['weights_loaded']} tensors loaded)" if info["weights_loaded"] is not None
           else " (weights not loaded)") + f", built in {info['build_seconds']:.2f}s",
        f"kv cache:     {kv['dtype']}, block_size {kv['block_size']}, {kv['attention_layers']} attention layers, "
        f"{kv['bytes_per_token']:,} bytes/token, {kv['bytes_per_block']:,} bytes/block",
        *([f"state:        {state['layers']} recurrent (linear attention) layers, "
           f"{state['bytes_per_sequence']:,} bytes/sequence (one slot per --max-num-seqs)"]
          if (state := info.get("recurrent_state")) else []),
        "ops:",
    ]
    for op in info["ops"]:
        spec = op["spec"]
        shown = ", ".join(f"{k}={v}" for k, v in spec.items() if k != "kind" and v is not None)
        lines.append(f"  {spec['kind']} [{shown}] -> {op['builder']} (priority {op['priority']})")
        for rej in op["rejected"]:
            lines.append(f"      rejected {rej['builder']}: {'; '.join(rej['reasons'])}")
        if op["not_tried"]:
            lines.append(f"      not tried (lower priority): {', '.join(op['not_tried'])}")
    return "\n".join(lines)
