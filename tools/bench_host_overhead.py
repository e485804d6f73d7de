"""The engine's host time per decode step, with the model taken out: the default model's
forward returns zeros, its LM head an empty row per sequence and the sampler random token
ids, so a step is only what the host does around the model (scheduling, building inputs,
appending tokens, detokenizing, outputs; not the sampler's arithmetic). On a GPU this
time adds to every step unless it overlaps; at 256 rows of an 8B model a step is ~20-30 ms
of device time.

`--device-ms D` simulates such a device: each launched step completes D ms after the
previous one did (or after its launch, if the queue was empty), like kernels queued on one
CUDA stream, and reading its tokens waits until then. Synchronous steps then take host + D;
with `--async-scheduling` the host's work hides under the next step, max(host, D).

    python tools/bench_host_overhead.py --rows 256 --output-len 64 --repeats 3
    python tools/bench_host_overhead.py --rows 256 --device-ms 20 [--async-scheduling]

With `--num-prompts`, `--num-kv-blocks` and `--max-num-batched-tokens` it replays a GPU
run's scheduling (steps, steps with prefill, preemptions, tokens computed against the
workload's own), e.g. the H100 throughput run's (27416 blocks of 16 tokens in bf16):

    python tools/bench_host_overhead.py --rows 256 --num-prompts 1000 --input-len 1000 \
        --output-len 1000 --num-kv-blocks 27416 --max-num-batched-tokens 8192 --repeats 1
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from tessera import LLM, SamplingParams
from tessera.sampling.sampler import SamplerOutput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="sequences decoding together")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device-ms", type=float, default=0.0,
                        help="simulated device time per step (0: none, the host time alone)")
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: --rows")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: room for every row's tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: every row's prompt in one step")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens = args.rows * (args.input_len + args.output_len)
    llm = LLM(None, dtype="bfloat16", device="cpu", show_progress=False, max_num_seqs=args.rows,
              max_num_batched_tokens=args.max_num_batched_tokens or max(args.rows * args.input_len, 1024),
              num_kv_blocks=args.num_kv_blocks or tokens // 16 + args.rows,
              max_model_len=args.input_len + args.output_len, async_scheduling=args.async_scheduling)
    runner = llm.engine.runner
    hidden = runner.model.config.hidden_size
    g = torch.Generator().manual_seed(0)
    runner._run_model = lambda inputs: torch.zeros(inputs.input_ids.shape[0], hidden, dtype=torch.bfloat16)
    runner.model.compute_logits = lambda h: h[:, :1].float()
    runner.sampler.sample = lambda logits, batch: SamplerOutput(
        torch.randint(100, 40000, (logits.shape[0],), generator=g))
    if args.device_ms:
        simulate_device(runner, args.device_ms / 1e3)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)]
               for _ in range(args.num_prompts or args.rows)]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    engine, step = llm.engine, llm.engine.step
    times: list[float] = []
    # each launch: (prefills a prompt (or a preempted sequence's tokens), tokens computed)
    launch, computed = runner.launch, []

    def counted(scheduled, previous=None):
        computed.append((any(item.seq.num_computed_tokens < item.seq.num_tokens - 1 for item in scheduled),
                         sum(item.num_new_tokens for item in scheduled)))
        return launch(scheduled, previous)

    runner.launch = counted

    def timed(*a, **kw):
        start, launches = time.perf_counter(), len(computed)
        out = step(*a, **kw)
        # a decode step: it launched only decode rows (or nothing: the last step's drain)
        times.append((time.perf_counter() - start, any(p for p, _ in computed[launches:])))
        return out

    engine.step = timed
    for r in range(args.repeats):
        times.clear()
        computed.clear()
        preempted = engine.stats().num_preemptions
        llm.generate(prompts, params, use_tqdm=False)
        decode = [t for t, prefill in times if not prefill]
        # a workload's own tokens: each prompt's, then every output token but the last
        own = len(prompts) * (args.input_len + args.output_len - 1)
        print(f"run {r + 1}: {len(times)} steps, decode step median {statistics.median(decode) * 1e3:.2f} ms; "
              f"{sum(1 for prefill, _ in computed if prefill)} steps with prefill, "
              f"{engine.stats().num_preemptions - preempted} preemptions, "
              f"{sum(n for _, n in computed)} tokens computed for the workload's {own}")


def simulate_device(runner, step_seconds: float) -> None:
    """Launched steps complete one after another, `step_seconds` each, as on a stream."""
    launch = runner.launch
    queue_end = [0.0]

    def queued(scheduled, previous=None):
        step = launch(scheduled, previous)
        done = max(time.perf_counter(), queue_end[0]) + step_seconds
        queue_end[0] = done
        result = step.result

        def wait_then_read():
            time.sleep(max(0.0, done - time.perf_counter()))
            return result()

        step.result = wait_then_read
        return step

    runner.launch = queued


if __name__ == "__main__":
    main()
