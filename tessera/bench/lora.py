"""`tessera bench lora`: what serving LoRA adapters costs, in the same engine and run.

Per batch size, the same greedy requests run three ways: on the base model, all with one
adapter, and spread round-robin over `max_loras` adapters (each step then runs that many
adapters' segments). The adapters are random PEFT folders of rank `max_lora_rank` on every
attention and MLP projection, written for the model's own shapes (nothing to download).
Steps with adapter rows run eagerly (captured decode graphs replay the base model only),
so on CPU the cost includes leaving the kernel graphs.
"""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from tessera.bench.workload import Workload, median
from tessera.engine.engine import Engine
from tessera.lora.adapter import CONFIG_FILE, PEFT_PREFIX, WEIGHTS_FILE, full_shape
from tessera.lora.request import LoRARequest
from tessera.ops.linear import PackedLinear
from tessera.sampling.params import SamplingParams


@dataclass
class LoRAResult:
    engine: str                # "tessera, base model" / "tessera, 1 adapter" / "tessera, 4 adapters"
    batch_size: int
    ms_per_token: float        # wall time of a batch over its output length
    output_tokens_per_s: float


def write_random_adapter(engine: Engine, folder: Path, rank: int, seed: int) -> Path:
    """A PEFT adapter folder for `engine`'s model: rank `rank` on every linear layer that
    has LoRA slots, under the Hugging Face module names."""
    generator = torch.Generator().manual_seed(seed)
    hf_names = {packed: fragment for fragment, packed in getattr(engine.model, "packed_modules_mapping", {}).items()}
    tensors = {}
    for name, layer_lora in engine.runner.lora.layers.items():
        layer = layer_lora.layer
        parent, _, leaf = name.rpartition(".")
        shards = list(layer.shard_sizes) if isinstance(layer, PackedLinear) else [None]
        for shard in shards:
            module = f"{parent}.{hf_names[(leaf, shard)] if shard is not None else leaf}"
            in_features, out_features = full_shape(layer, shard)
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    return folder


def lora_bench(engine: Engine, batch_sizes: list[int], input_len: int, output_len: int,
               repeats: int) -> list[LoRAResult]:
    if engine.loras is None:
        raise ValueError("the engine was built without LoRA (--enable-lora)")
    lora = engine.config.lora
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="tessera-bench-lora-") as tmp:
        names = []
        for i in range(lora.max_loras):
            name = f"bench-{i}"
            folder = write_random_adapter(engine, Path(tmp) / name, lora.max_lora_rank, seed=i)
            engine.add_lora(LoRARequest(name, i + 1, str(folder)))
            names.append(name)
        modes = {"tessera, base model": [None], "tessera, 1 adapter": names[:1],
                 f"tessera, {len(names)} adapters": names}
        for size in batch_sizes:
            prompts = Workload(size, input_len, output_len).prompts(engine.router.config.vocab_size,
                                                                    engine.router.eos_token_ids)
            times: dict[str, list[float]] = {mode: [] for mode in modes}
            for r in range(repeats + 1):  # the first round warms up
                for mode, adapters in modes.items():
                    loras = [adapters[i % len(adapters)] for i in range(size)]
                    elapsed = _run(engine, f"lora-{size}-{r}-{mode}", prompts, params, loras)
                    if r:
                        times[mode].append(elapsed)
            for mode in modes:
                elapsed = median(times[mode])
                results.append(LoRAResult(mode, size, 1e3 * elapsed / output_len, size * output_len / elapsed))
    return results


def _run(engine: Engine, prefix: str, prompts: list[list[int]], params: SamplingParams,
         loras: list[str | None]) -> float:
    engine.reset_prefix_cache()  # every mode computes its prompts
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, prompt, lora in zip(ids, prompts, loras):
        engine.add_request(request_id, prompt, params, lora)
    for _ in engine.iter_outputs(ids, stream=False):
        pass
    return time.perf_counter() - start
