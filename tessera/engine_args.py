"""Engine arguments on the command line: the flags `tessera serve | generate | bench` share,
and the EngineConfig (or LLM) they build. Reads the environment variables that stand in for
flags (TESSERA_CACHE_DIR, the watermark's, torchrun's)."""
from __future__ import annotations

import argparse
import json
import logging
import os

from tessera.config import (DTYPES, GENERATION_CONFIGS, KV_CACHE_DTYPES, LOAD_FORMATS, MODEL_IMPLS,
                            QUANTIZATIONS, RUNNERS, SCHEDULING_POLICIES)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder, if not the model's")
    p.add_argument("--mmproj", default=None,
                   help="a GGUF model's multimodal projector file (llama.cpp's mmproj GGUF: Gemma 3's, Gemma 4's, "
                        "Mistral Small 3.1 / 3.2's, Qwen2-VL's, Qwen2.5-VL's, Qwen3-VL's): the model then takes images")
    p.add_argument("--model-impl", default="auto", choices=MODEL_IMPLS,
                   help="native: a tessera model folder; transformers: transformers' modeling code with "
                        "tessera's paged attention; auto: native when a folder serves the type")
    p.add_argument("--generation-config", default="auto", choices=GENERATION_CONFIGS,
                   help="auto: the model's generation_config.json sets the default temperature, top_p, "
                        "top_k, min_p and repetition_penalty of requests (and `tessera generate` flags) that "
                        "leave them out, and its max_new_tokens caps OpenAI requests' max_tokens (as in "
                        "vLLM); vllm: neutral defaults")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto: bfloat16 on GPUs, on CPUs with native bf16 and on AVX512 / AVX2 CPUs "
                        "where tessera's kernels build; else float32")
    p.add_argument("--device", default="auto",
                   help="auto (default: an NVIDIA GPU of compute capability 8.0+ when torch sees one "
                        "per tensor-parallel rank, else the CPU; $TESSERA_DEVICE sets what auto means), "
                        "cpu or cuda[:N]")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None,
                   help="most sequences decoded together (max_num_seqs; default 64 on CPU, 256 on CUDA)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step, prefill chunks + decodes (default 1024 on CPU, "
                        "256 for `serve` on CPU; 8192 on CUDA)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="fix the KV cache size instead of sizing it from free memory")
    p.add_argument("--memory-fraction", type=float, default=None,
                   help="share of free memory for the KV cache (default 0.2 on CPU, 0.9 on CUDA)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV cache storage: auto (the model dtype) or 8-bit floats, fp8 (= fp8_e4m3, "
                        "TGI's fp8_e4m3fn) or fp8_e5m2: twice the tokens of a bf16 cache in the same "
                        "memory and half the bytes read per cached token, at some accuracy")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse cached KV blocks of shared prompt prefixes")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt in one step (needs --max-num-batched-tokens >= max model length)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file overriding the tokenizer's")
    p.add_argument("--mm-processor-kwargs", type=_json_object, default=None, metavar="JSON",
                   help="models that take images: settings for their image processor (vLLM's flag), e.g. "
                        "'{\"max_pixels\": 1003520}' to bound Qwen2-VL's image sizes, "
                        "'{\"do_pan_and_scan\": true}' for Gemma 3's crops")
    p.add_argument("--runner", default="auto", choices=RUNNERS,
                   help="pooling: serve embeddings (/v1/embeddings, TEI's /embed) from the model's "
                        "hidden states instead of generating text; auto (default) does so for "
                        "sentence-transformers folders and bare backbones (architectures *Model)")
    p.add_argument("--pooler-config", type=_json_object, default=None, metavar="JSON",
                   help="embedding models: override the checkpoint's pooling, e.g. "
                        "'{\"pooling_type\": \"MEAN\", \"normalize\": false}' (LAST, MEAN or CLS), "
                        "'{\"is_matryoshka\": true}' to allow requests' `dimensions`; "
                        "'{\"classifier_from_token\": [\"no\", \"yes\"]}' scores pairs by a causal LM's "
                        "logits of those tokens (Qwen3-Reranker)")
    p.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling")
    p.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="dummy: seeded random weights for the model's config (benchmark real shapes "
                        "from a config.json alone; give --tokenizer if the folder has none)")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATIONS[1:],
                   help="int8: linear weights quantized per output feature after loading "
                        "(half the weight memory; faster single-stream decode on CPU); int4: in "
                        "groups of 32 as GGUF's Q4_1 (a third of bf16's weight bytes; the LM head "
                        "takes int8). Both trade a little accuracy for the bytes. none: the model "
                        "dtype. Default: a GGUF stored as Q4_0 / Q4_1 / Q4_K (the default model, "
                        "Q4_K_M files) runs as stored, in int4, on CPU with bf16 (dense matrices the "
                        "file keeps at more than 5 bits in int8); anything else in the model dtype")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every decode step op by op instead of replaying captured graphs "
                        "(kernel graphs on CPU, CUDA graphs on GPU)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="launch each step before the last one's tokens reach the host, so scheduling "
                        "and output processing overlap the GPU. Default: on for CUDA (one rank, no "
                        "speculation), off on CPU (no gain there: a step's outputs come a step later)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 4}\' '
                        '(drafts from n-grams of the sequence itself), or \'{"model": "PATH", '
                        '"num_speculative_tokens": 4}\' (drafts from a smaller model of the same vocabulary; '
                        '"quantization": "int8" or "int4" for its weights). The output is what the model alone '
                        'would give; no drafts while more than disable_by_batch_size sequences run or '
                        'wait: default 2 on CPU, none on CUDA')
    p.add_argument("--speculate", type=int, default=None, metavar="N",
                   help="as TGI: speculative decoding with N n-gram draft tokens per step "
                        "(--speculative-config with its defaults)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="shard the model over this many ranks (gloo on CPU, NCCL on CUDA)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="where the ranks meet (MASTER_ADDR when launched by torchrun)")
    p.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port (default: a free one; MASTER_PORT when launched by torchrun)")
    p.add_argument("--logprobs-mode", default="raw", choices=("raw", "processed"),
                   help="logprobs from the model's distribution (raw) or the one sampled from (processed)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
                   help="fcfs: first come, first served; priority: requests' `priority` first (lower "
                        "sooner), then arrival, and preemption takes the least urgent (vLLM's)")
    add_watermark_args(p)
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters on top of the model (several in one batch)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="PEFT adapter folders to load at start-up, as NAME=PATH or vLLM's JSON "
                        '\'{"name": ..., "path": ...}\' (implies --enable-lora); clients pick one by '
                        "name (OpenAI `model`, TGI `adapter_id`)")
    p.add_argument("--lora-adapters", default=None, metavar="NAME=PATH,...",
                   help="TGI's launcher flag (`serve` also reads LORA_ADAPTERS): comma-separated "
                        "NAME=PATH adapters, as --lora-modules (no hub here: give local folders)")
    p.add_argument("--max-loras", type=int, default=4,
                   help="distinct adapters one step can run (device slots per layer; default 4)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted (default 16)")


def add_watermark_args(p: argparse.ArgumentParser) -> None:
    """The watermark's settings, defaulting to TGI's variables and TESSERA_WATERMARK_KEY
    (a key in the environment stays out of the process list)."""
    env = os.environ
    p.add_argument("--watermark-gamma", type=float, default=env.get("WATERMARK_GAMMA", "0.5"),
                   help="share of the vocabulary that is green at each step (default 0.5 or WATERMARK_GAMMA)")
    p.add_argument("--watermark-delta", type=float, default=env.get("WATERMARK_DELTA", "2.0"),
                   help="bias added to green tokens' logits (default 2.0 or WATERMARK_DELTA)")
    p.add_argument("--watermark-key", type=_secret_int, default=env.get("TESSERA_WATERMARK_KEY", "15485863"),
                   help="secret seeding the green lists (default TESSERA_WATERMARK_KEY, else the "
                        "public 15485863 that TGI and transformers use: set your own to deploy)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def image_limit(text: str) -> int:
    """--limit-mm-per-prompt: vLLM's JSON ({"image": N}), or N alone."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"expected '{{\"image\": N}}', got {text!r}") from None
    if isinstance(value, dict):
        unknown = set(value) - {"image"}
        if unknown:
            raise argparse.ArgumentTypeError(f"tessera takes images only; got {sorted(unknown)}")
        value = value.get("image", 8)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise argparse.ArgumentTypeError(f"the image limit is a count >= 0, got {value!r}")
    return value


def _secret_int(text: str) -> int:
    """int(text), with an error that does not print the text (a key)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError("must be an integer (the value is not shown: it is a key)") from None


def watermark_config(args: argparse.Namespace):
    from tessera.config import WatermarkConfig

    return WatermarkConfig(gamma=args.watermark_gamma, delta=args.watermark_delta, key=args.watermark_key)


def parallel_config(args: argparse.Namespace):
    """Spawned ranks by default; ranks launched per node when torchrun's variables (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK) are set."""
    from tessera.config import ParallelConfig

    tp, env = args.tensor_parallel_size, os.environ
    if tp > 1 and "RANK" in env and "WORLD_SIZE" in env:
        if int(env["WORLD_SIZE"]) != tp:
            raise SystemExit(f"WORLD_SIZE={env['WORLD_SIZE']} but --tensor-parallel-size {tp}: "
                             "every rank of the group holds one shard, so they must match")
        port = env.get("MASTER_PORT") or args.master_port
        if port is None:
            raise SystemExit("launched ranks meet at MASTER_ADDR:MASTER_PORT; set MASTER_PORT or --master-port")
        return ParallelConfig(tp, master_addr=env.get("MASTER_ADDR", args.master_addr),
                              master_port=int(port), launched=True, rank=int(env["RANK"]),
                              local_rank=int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else None)
    return ParallelConfig(tp, master_addr=args.master_addr, master_port=args.master_port)


def engine_config_from_args(args: argparse.Namespace):
    from tessera.llm import engine_config

    cache_dir = os.environ.get("TESSERA_CACHE_DIR")
    return engine_config(args.model, dtype=args.dtype, tokenizer=args.tokenizer, max_model_len=args.max_model_len,
               max_num_seqs=args.batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
               block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
               kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=not args.no_prefix_caching,
               enable_chunked_prefill=not args.no_chunked_prefill,
               memory_fraction=args.memory_fraction, device=args.device, seed=args.seed,
               chat_template=args.chat_template, cache_dir=cache_dir, logprobs_mode=args.logprobs_mode,
               model_impl=args.model_impl, load_format=args.load_format,
               quantization=args.quantization, enforce_eager=args.enforce_eager,
               generation_config=args.generation_config, mm_processor_kwargs=args.mm_processor_kwargs,
               mmproj=args.mmproj,
               runner=args.runner, pooler_config=args.pooler_config,
               async_scheduling=args.async_scheduling, scheduling_policy=args.scheduling_policy,
               speculative_config=speculative_config(args),
               parallel=parallel_config(args), watermark=watermark_config(args), **lora_args(args))


def lora_args(args: argparse.Namespace) -> dict:
    modules: dict[str, str] = {}
    tgi = [item.strip() for item in (args.lora_adapters or "").split(",") if item.strip()]
    for item in [*(args.lora_modules or ()), *tgi]:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
            except json.JSONDecodeError as exc:
                raise SystemExit(f"--lora-modules {item!r} is not JSON: {exc}") from None
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
                raise SystemExit(f'--lora-modules {item!r}: the JSON form is {{"name": ..., "path": ...}}')
            name, path = spec["name"], spec["path"]
        else:
            name, sep, path = item.partition("=")
            name, path = name.strip(), path.strip()
            if not sep or not name or not path:
                raise SystemExit(f"LoRA adapter {item!r}: expected NAME=PATH (a local PEFT folder; "
                                 "nothing is downloaded)")
        if name in modules:
            raise SystemExit(f"--lora-modules names {name!r} twice")
        modules[name] = path
    runtime = getattr(args, "allow_runtime_lora_updating", False)  # (serve) loads need the slots
    return {"enable_lora": args.enable_lora or bool(modules) or runtime, "max_loras": args.max_loras,
            "max_lora_rank": args.max_lora_rank, "lora_modules": modules}


def speculative_config(args: argparse.Namespace) -> dict | None:
    if args.speculative_config is not None and args.speculate is not None:
        raise SystemExit("give --speculative-config or --speculate, not both")
    if args.speculate is not None:
        return {"method": "ngram", "num_speculative_tokens": args.speculate}
    if args.speculative_config is None:
        return None
    try:
        value = json.loads(args.speculative_config)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SystemExit("--speculative-config must be a JSON object")
    return value


def serve_rank_if_not_driver(config) -> bool:
    """On a launched rank > 0: serve the driver's steps until it shuts down; True when done."""
    if not (config.parallel.launched and config.parallel.rank != 0):
        return False
    from tessera.distributed.worker import launched_rank_main

    logging.getLogger(__name__).info("rank %d of %d: following the driver at %s:%s",
                                     config.parallel.rank, config.parallel.tensor_parallel_size,
                                     config.parallel.master_addr, config.parallel.master_port)
    launched_rank_main(config)
    return True


def make_llm(args: argparse.Namespace, config=None):
    from tessera.llm import LLM

    return LLM(config=config or engine_config_from_args(args), show_progress=True)
