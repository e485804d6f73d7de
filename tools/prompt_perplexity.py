"""The perplexity a model gives a text, read as prompts: how much a weight format or dtype
costs in accuracy, on the same tokens.

    python tools/prompt_perplexity.py [--model M] [--dtype bfloat16] [--quantization none|int8|int4]
                                      [--file README.md] [--tokens 1500] [--chunk 500]

The first `--tokens` tokens of the file go in as prompts of `--chunk` tokens; each token's
log-probability given the ones before it in its prompt (`prompt_logprobs=0`) is averaged.
Without --quantization the engine's default applies (int4 for a Q4_0 / Q4_1 GGUF on CPU).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from tessera import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default=None, choices=("none", "int8", "int4"))
    parser.add_argument("--file", default=str(Path(__file__).resolve().parents[1] / "README.md"))
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--chunk", type=int, default=500)
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, show_progress=False)
    ids = llm.engine.encode(Path(args.file).read_text())[:args.tokens]
    if len(ids) < 2:
        raise SystemExit(f"{args.file} has fewer than 2 tokens")
    chunks = [ids[i:i + args.chunk] for i in range(0, len(ids), args.chunk)]
    outputs = llm.generate(chunks, SamplingParams(max_new_tokens=1, prompt_logprobs=0, temperature=0.0))
    nll = []
    for chunk, out in zip(chunks, outputs):
        for token, logprobs in zip(chunk[1:], out.prompt_logprobs[1:]):
            entry = logprobs[token]
            nll.append(-(entry.logprob if hasattr(entry, "logprob") else entry))
    mean = sum(nll) / len(nll)
    print(f"{llm.engine.router.source.name}: dtype {str(llm.engine.dtype).removeprefix('torch.')}, "
          f"weights {llm.engine.quantization or 'model dtype'}; {len(nll)} tokens, mean NLL {mean:.4f}, "
          f"perplexity {math.exp(mean):.2f}")


if __name__ == "__main__":
    main()
