"""Triton launches per step of a tiny Llama (2 layers, random weights) with every CUDA
builder run by Triton's interpreter on CPU: how many kernels a decode layer takes on the
GPU path, without a GPU. Eager steps and untuned linears (cuBLAS's place is taken by torch's
CPU matmul, which launches no Triton kernel); with --fused, the linears tuned by a stand-in
timer under which every few-row kernel beats its reference, so each fused kernel that can
run does (a GPU's tuning keeps only those that measure faster).

    python tools/count_decode_kernels.py [float16|bfloat16|float32] [--fused]
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported


def main() -> None:
    import triton.runtime.interpreter as interpreter

    from tessera import LLM, SamplingParams
    from tessera.bench.presets import write_preset
    from tessera.ops.triton.interpreted import expose_triton_builders_on_cpu

    from tessera.ops.kernel_tuning import kernel_tuning
    from tessera.ops.triton import skinny_linear

    args = [a for a in sys.argv[1:] if a != "--fused"]
    dtype = args[0] if args else "float16"
    fused = "--fused" in sys.argv
    if fused:
        skinny_linear._num_sms = lambda device: 4
        skinny_linear._timer = lambda device: lambda runs: {name: 2e-5 if name == "torch" else 1e-5 for name in runs}
    expose_triton_builders_on_cpu()
    counts: collections.Counter[str] = collections.Counter()
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, **kwargs):
        counts[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    interpreter.InterpretedFunction.run = counted
    folder = write_preset("llama-3.2-1b", Path(tempfile.mkdtemp()))
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                  bos_token_id=1, eos_token_id=2)
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), load_format="dummy", dtype=dtype, enforce_eager=True, show_progress=False,
              num_kv_blocks=64, max_model_len=1024)
    prompt = list(range(100, 300))  # 200 tokens: more than one decode partition
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with kernel_tuning() if fused else contextlib.nullcontext():  # untuned: cuBLAS's place
        llm.generate([prompt], params, use_tqdm=False)  # compiles (interprets) everything once
    counts.clear()
    llm.generate([prompt[::-1]], params, use_tqdm=False)  # a prefill step, then 4 decode steps
    layers = config["num_hidden_layers"]
    print(f"{dtype}{' (fused kernels chosen)' if fused else ''}: Triton launches over one prefill and 4 decode "
          f"steps of {layers} layers")
    for name, n in sorted(counts.items()):
        print(f"  {name:<24} {n:>3}")


if __name__ == "__main__":
    main()
