"""`tessera bench speculative`: speculative decoding on vs off, in the same engine and run.

The engine's own proposer is measured: n-gram drafts or a draft model's. N-gram drafts pay
off where the output repeats the input, and cost a little where it does not, so two
built-in chat workloads are measured: "quote" asks to write out a given
passage again (editing, extraction and code changes look like this), "free" asks for new
text. Greedy decoding; every prompt runs (in consecutive batches of the batch size); prompts
cached by a warm-up round; off and on alternating per repeat.
Besides speed, each row says how many outputs equal the plain run's: with float32 all
should; with bf16 a verifying step (more rows than the plain one) may round differently
and flip a near-tie, as a different batch size may.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass

from tessera.bench.workload import median
from tessera.engine.engine import Engine
from tessera.sampling.params import SamplingParams

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens until it shone, and wrote the weather in a leather logbook: wind from "
    "the west, a light swell, three fishing boats returning before dark.",
    "To reset the router, hold the small button on the back panel for ten seconds until the lights "
    "blink orange. Wait two minutes for it to restart, then connect to the network named on the "
    "sticker and open the setup page in a browser.",
    "Honey bees communicate the location of flowers with a waggle dance. The angle of the dance "
    "shows the direction relative to the sun, and the length of the waggle run tells the other bees "
    "how far they must fly to reach the food.",
    "def moving_average(values, window):\n    totals = []\n    for i in range(len(values) - window + 1):"
    "\n        chunk = values[i:i + window]\n        totals.append(sum(chunk) / window)\n    return totals",
    "The committee met on Tuesday to review the budget. Travel costs rose by twelve percent, while "
    "spending on equipment fell. The chair asked each team to submit a revised plan by the end of "
    "the month, with a short note explaining every change.",
    "Bread dough needs time to rise. Mix flour, water, salt and yeast, knead for ten minutes, then "
    "leave the bowl covered in a warm place for an hour. Shape the loaf, let it rise again, and "
    "bake it in a hot oven until the crust is golden.",
    "A binary search halves the range it looks at on every step. It compares the middle element with "
    "the target, then keeps the left half or the right half, so a sorted list of a million items "
    "needs at most twenty comparisons.",
    "The river flooded twice that spring. Farmers moved their animals to higher fields, the school "
    "closed for a week, and volunteers filled sandbags along the main street until the water "
    "finally began to fall.",
]
TOPICS = ["a fox who learns to swim", "a robot that paints", "a lost key", "the last train home",
          "a garden on the moon", "two rival bakers", "a letter that arrives forty years late",
          "a storm at sea"]
WORKLOADS = {
    "quote": [f"Repeat the following text exactly, word for word:\n\n{p}" for p in PASSAGES],
    "free": [f"Write a short story about {t}." for t in TOPICS],
}


@dataclass
class SpeculativeResult:
    engine: str                  # "tessera, speculation off" / "tessera, ngram k=4"
    workload: str                # quote / free
    batch_size: int
    ms_per_token: float          # wall time of a batch over its mean output length
    output_tokens_per_s: float
    tokens_per_step: float       # per verifying sequence step: accepted drafts + 1 (0 when off)
    acceptance_rate: float       # accepted / proposed drafts
    same_as_plain: str           # outputs equal to the plain run's, "k/n"


def speculative_bench(engine: Engine, batch_sizes: list[int], output_len: int,
                      repeats: int) -> list[SpeculativeResult]:
    """Per workload and batch size, a row with speculation off and one with it on (the
    engine's speculative config: it must be on, so warm-up sized the LM head's pass)."""
    config = engine.config.speculative
    if not config.enabled:
        raise ValueError("the engine was built without speculative decoding")
    # every batch size speculates here, whatever disable_by_batch_size says: that limit is
    # what this measures
    saved = engine.proposer
    proposer = copy.copy(saved)  # (a draft model's proposer keeps its model and cache)
    proposer.config = dataclasses.replace(config, disable_by_batch_size=None)
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0)
    results = []
    try:
        for name, texts in WORKLOADS.items():
            prompts = [_chat_prompt(engine, text) for text in texts]
            for size in batch_sizes:
                # every prompt at least once: consecutive batches of `size`
                count = max(size, len(prompts))
                batches = [[prompts[i % len(prompts)] for i in range(start, min(start + size, count))]
                           for start in range(0, count, size)]
                runs: dict[bool, list[tuple[float, list[list[int]], tuple[int, int, int]]]] = {False: [], True: []}
                for r in range(repeats + 1):  # the first round warms up (and caches the prompts)
                    for on in (False, True):
                        engine.proposer = proposer if on else None
                        run = _generate_batches(engine, f"spec-{name}-{size}-{r}-{on}", batches, params)
                        if r:
                            runs[on].append(run)
                plain_outputs = runs[False][0][1]
                for on in (False, True):
                    elapsed = median([t for t, _, _ in runs[on]])
                    outputs = runs[on][0][1]
                    tokens = sum(map(len, outputs))
                    steps, drafts, accepted = runs[on][0][2]
                    same = sum(a == b for a, b in zip(outputs, plain_outputs))
                    method = "draft model" if config.method == "draft_model" else config.method
                    label = f"tessera, {method} k={config.num_speculative_tokens}" if on else "tessera, speculation off"
                    results.append(SpeculativeResult(
                        label, name, size, 1e3 * elapsed * size / tokens, tokens / elapsed,
                        1 + accepted / steps if steps else 0.0, accepted / drafts if drafts else 0.0,
                        f"{same}/{len(outputs)}"))
    finally:
        engine.proposer = saved
    return results


def _chat_prompt(engine: Engine, text: str) -> list[int]:
    """The text as a user turn under the model's chat template, or as is without one."""
    template = engine.router.chat_template
    if not template:
        return engine.encode(text)
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], chat_template=template,
                                                    tokenize=False, add_generation_prompt=True)
    return list(engine.tokenizer(rendered, add_special_tokens=False).input_ids)


def _generate_batches(engine: Engine, prefix: str, batches: list[list[list[int]]],
                      params: SamplingParams) -> tuple[float, list[list[int]], tuple[int, int, int]]:
    """Each batch run to its end, one after the other: seconds, output token ids per
    prompt, and (verifying steps, drafts, accepted) counted during the run."""
    before = engine.stats()
    start = time.perf_counter()
    ids, outputs = [], {}
    for b, prompts in enumerate(batches):
        batch_ids = [f"{prefix}-{b}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(batch_ids, prompts):
            engine.add_request(request_id, prompt, params)
        outputs.update((o.request_id, o.outputs[0].token_ids)
                       for o in engine.iter_outputs(batch_ids, stream=False) if o.finished)
        ids += batch_ids
    elapsed = time.perf_counter() - start
    after = engine.stats()
    counts = (after.spec_num_drafts - before.spec_num_drafts, after.spec_draft_tokens - before.spec_draft_tokens,
              after.spec_accepted_tokens - before.spec_accepted_tokens)
    return elapsed, [outputs[i] for i in ids], counts
