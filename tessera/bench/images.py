"""`tessera bench images`: what an image costs a prompt, in one run.

Per --image-sizes (square images of random pixels), one request whose prompt is a short text
with the image's placeholder, beside one of the same number of text tokens (the baseline):
- encode: the vision encoder alone on the processed image (median of --repeats);
- TTFT: from add_request to the first token, the prefix cache and the cache of encoded
  images reset before each run, so the image request pays its encoding and the prefill of
  all its tokens;
- TPOT: the decode steps after it (the image's tokens are ordinary cached context then).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import count

import numpy as np
import torch
from PIL import Image

from tessera.bench.workload import median
from tessera.engine.engine import Engine
from tessera.sampling.params import SamplingParams

_ids = count()


@dataclass
class ImageBenchResult:
    engine: str          # "tessera, 448x448 image" / "tessera, text only"
    prompt_tokens: int
    image_tokens: int
    encode_ms: float | None
    ttft_ms: float
    tpot_ms: float


def _random_image(side: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((side, side, 3)) * 255).astype("uint8"))


def _run(engine: Engine, ids: list[int], images, output_len: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds of one greedy request running alone."""
    engine.reset_prefix_cache()
    engine.reset_mm_cache()
    request_id = f"bench-images-{next(_ids)}"
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    engine.add_request(request_id, ids, params, multimodal=images)
    first = last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.outputs[0].token_ids and first is None:
                first = time.perf_counter()
            if out.finished:
                last = out
    finished = time.perf_counter()
    made = len(last.outputs[0].token_ids)
    return first - started, (finished - first) / max(made - 1, 1)


def images_bench(engine: Engine, image_sizes: list[int], text_len: int, output_len: int,
                 repeats: int) -> list[ImageBenchResult]:
    if not engine.supports_images:
        raise SystemExit(f"{engine.router.source.name} takes no images (`tessera models`: IMAGES)")
    prompts = engine.router.image_prompts
    vocab = min(len(engine.tokenizer), engine.router.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    filler = engine.tokenizer.decode(torch.randint(100, vocab, (text_len,), generator=g).tolist())
    rows = []
    for index, side in enumerate(image_sizes):
        image = _random_image(side, index)
        ids, images = engine.process_images(f"Describe {prompts.placeholder} {filler}", [image])
        encodes, ttfts, tpots = [], [], []
        for _ in range(repeats):
            started = time.perf_counter()
            engine.model.encode_images(images.images[0].encoder_inputs)
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            encodes.append(time.perf_counter() - started)
            ttft, tpot = _run(engine, ids, images, output_len)
            ttfts.append(ttft)
            tpots.append(tpot)
        rows.append(ImageBenchResult(f"tessera, {side}x{side} image", len(ids), images.num_features,
                                     median(encodes) * 1e3, median(ttfts) * 1e3, median(tpots) * 1e3))
        text = torch.randint(100, vocab, (len(ids),), generator=g).tolist()
        runs = [_run(engine, text, None, output_len) for _ in range(repeats)]
        rows.append(ImageBenchResult(f"tessera, text only ({len(ids)} tokens)", len(ids), 0, None,
                                     median([r[0] for r in runs]) * 1e3, median([r[1] for r in runs]) * 1e3))
    return rows
