"""A constraint that starts after a reasoning model's end-of-thinking token
(`SamplingParams.reasoning_end_token_id`): until the output writes that token it is the
model's own, token for token what it writes unconstrained; from the next token on it
follows the constraint; an output that never ends its reasoning is never constrained.
Through the engine on the tiny random llama, with async scheduling and preemption too."""
from __future__ import annotations

import re

import pytest

from tessera import LLM, SamplingParams
from tessera.engine.engine import RequestError
from tessera.sampling.params import SamplingParamsError
from tests.engine.test_engine import TEXTS, tiny  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest

REGEX = r"[ab]{2,4}-[0-9]"


def _free(llm: LLM, prompt: str, n: int) -> list[int]:
    return llm.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids


def _end_token(free: list[int], at_least: int) -> int:
    """The position of a token the free output writes first at or after `at_least`."""
    return next(i for i in range(at_least, len(free)) if free[i] not in free[:i])


@pytest.mark.parametrize("settings", [{}, dict(async_scheduling=True), dict(num_kv_blocks=12)],
                         ids=["plain", "async", "preemption"])
def test_the_output_is_free_until_the_end_token_then_constrained(tiny, settings):
    with LLM(tiny, dtype="float32", show_progress=False, block_size=4,
             **{"num_kv_blocks": 256, **settings}) as llm:
        tokenizer = llm.engine.tokenizer
        prompts = TEXTS[:3]
        frees = [_free(llm, p, 16) for p in prompts]
        ends = [_end_token(free, 3 + i) for i, free in enumerate(frees)]
        params = [SamplingParams(max_new_tokens=40, temperature=0.0, structured_outputs={"regex": REGEX},
                                 reasoning_end_token_id=free[end]) for free, end in zip(frees, ends)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, free, end in zip(outs, frees, ends):
            c = out.outputs[0]
            assert c.token_ids[:end + 1] == free[:end + 1]  # the reasoning: the model's own
            answer = tokenizer.decode(c.token_ids[end + 1:], skip_special_tokens=True)
            assert re.fullmatch(REGEX, answer), (answer, c.text)
            assert c.finish_reason == "eos_token"  # the constraint completed and ended it
        if "num_kv_blocks" in settings:
            assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.block_manager.all_free()


def test_an_output_that_never_ends_its_reasoning_is_never_constrained(tiny):
    with LLM(tiny, dtype="float32", show_progress=False, num_kv_blocks=256, block_size=4) as llm:
        free = _free(llm, TEXTS[0], 20)
        absent = next(t for t in range(3, 500) if t not in free)
        params = SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True,
                                structured_outputs={"regex": REGEX}, reasoning_end_token_id=absent)
        c = llm.generate(TEXTS[0], params, use_tqdm=False)[0].outputs[0]
        assert c.token_ids == free and c.finish_reason == "length"
        assert not re.fullmatch(REGEX, c.text)  # the constraint would have changed it
        with pytest.raises(RequestError, match="reasoning_end_token_id"):
            llm.engine.add_request("too-big", TEXTS[0], SamplingParams(
                structured_outputs={"regex": REGEX}, reasoning_end_token_id=10 ** 6))
        assert not llm.engine.requests


def test_an_output_that_may_open_its_reasoning_opens_it_or_answers_at_once(tiny):
    """With an opening token, the first token may be it (the reasoning follows, free until
    the end token) or the constraint's (the answer starts at once): here the model's own
    first token opens it; kept from that token, the model answers under the constraint."""
    with LLM(tiny, dtype="float32", show_progress=False, num_kv_blocks=256, block_size=4) as llm:
        free = _free(llm, TEXTS[0], 16)
        end = _end_token(free, 3)
        fields = dict(max_new_tokens=40, temperature=0.0, structured_outputs={"regex": REGEX},
                      reasoning_end_token_id=free[end], reasoning_start_token_id=free[0])
        c = llm.generate(TEXTS[0], SamplingParams(**fields), use_tqdm=False)[0].outputs[0]
        assert c.token_ids[:end + 1] == free[:end + 1]
        assert re.fullmatch(REGEX, llm.engine.tokenizer.decode(c.token_ids[end + 1:], skip_special_tokens=True))
        c = llm.generate(TEXTS[0], SamplingParams(**fields, logit_bias={free[0]: -100.0}),
                         use_tqdm=False)[0].outputs[0]
        assert re.fullmatch(REGEX, c.text) and c.finish_reason == "eos_token", c.text


@pytest.mark.parametrize("fields, message", [
    (dict(reasoning_end_token_id=5), "applies to structured outputs or a thinking budget"),
    (dict(reasoning_end_token_id=-1, structured_outputs={"regex": "a"}), "token id >= 0"),
    (dict(reasoning_end_token_id="5", structured_outputs={"regex": "a"}), "token id >= 0"),
    (dict(reasoning_start_token_id=4, structured_outputs={"regex": "a"}), "needs `reasoning_end_token_id`"),
])
def test_a_bad_reasoning_end_token_is_refused(fields, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**fields)


@pytest.mark.parametrize("token", [0, 31, 32, 63, 400])
def test_also_allowing_adds_exactly_its_token_to_the_mask(token):
    import torch
    import xgrammar

    from tessera.sampling.structured import AlsoAllowing

    class AllowsNothing:
        def fill_next_token_bitmask(self, bitmask, row):
            bitmask[row] = 0

    bitmask = xgrammar.allocate_token_bitmask(2, 512)
    AlsoAllowing(AllowsNothing(), token).fill_next_token_bitmask(bitmask, 1)
    logits = torch.zeros(2, 512)
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=[1])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [token]  # bit 31: the sign bit
    assert torch.isfinite(logits[0]).all()
