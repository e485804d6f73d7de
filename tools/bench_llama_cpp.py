"""llama.cpp on the same GGUF and workload as `tessera bench latency --batch-sizes 1`: random
prompts of --input-len tokens, then --output-len greedy tokens, one stream; medians of
time to first token (the prompt's evaluation) and time per output token, first repeat
dropped (warm-up). Needs llama-cpp-python, which is not a tessera dependency (it builds
llama.cpp from source: `pip install llama-cpp-python`, about 15 minutes on 2 cores):

    python tools/bench_llama_cpp.py --model m.gguf --input-len 128 --output-len 128 --threads 2 [--no-extra-bufts]

--no-extra-bufts turns off llama.cpp's repacked weight buffers (its AMX and repacked-Q4_0
paths), which crashed with SIGILL (an AMX tile load) on the AMX host of docs/benchmarks.md,
session 37. Run it alone on the machine, alternating with tessera's command, as any timing.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--no-extra-bufts", action="store_true")
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed: pip install llama-cpp-python") from None

    if args.no_extra_bufts:  # (Llama() takes no such argument: its default parameters do)
        defaults = llama_cpp.llama_model_default_params

        def without_extra_bufts():
            params = defaults()
            params.use_extra_bufts = False
            return params
        llama_cpp.llama_model_default_params = llama_cpp.llama.llama_cpp.llama_model_default_params = without_extra_bufts
    llm = llama_cpp.Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads,
                          n_ctx=args.input_len + args.output_len + 8, n_batch=max(512, args.input_len),
                          verbose=False)
    vocab = llm.n_vocab()

    def greedy() -> int:  # the last position's logits (Llama.scores is filled only with logits_all)
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
    rng = np.random.default_rng(0)
    ttft, tpot = [], []
    for rep in range(args.repeats):
        prompt = [int(t) for t in rng.integers(100, vocab - 100, args.input_len)]
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        first = time.perf_counter()
        for _ in range(args.output_len - 1):
            llm.eval([greedy()])
        end = time.perf_counter()
        ttft.append((first - start) * 1e3)
        tpot.append((end - first) * 1e3 / max(1, args.output_len - 1))
        print(f"repeat {rep}: ttft {ttft[-1]:.1f} ms, tpot {tpot[-1]:.2f} ms", flush=True)
    keep = slice(1, None) if args.repeats > 1 else slice(None)
    print(f"llama.cpp ({args.threads} threads{', no extra bufts' if args.no_extra_bufts else ''}): "
          f"ttft {statistics.median(ttft[keep]):.1f} ms, tpot {statistics.median(tpot[keep]):.2f} ms")


if __name__ == "__main__":
    main()
