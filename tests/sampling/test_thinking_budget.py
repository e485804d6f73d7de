"""A thinking budget (`SamplingParams.thinking_token_budget`, vLLM's): the reasoning is the
model's own for that many tokens, then its end token is forced and the model answers after
it. Through the engine on the tiny random llama, with an arbitrary token standing in for
</think> (and for <think> where the output may open the reasoning)."""
from __future__ import annotations

import re

import pytest

from tessera import LLM, SamplingParams
from tessera.engine.thinking_budget import ThinkingBudget
from tessera.sampling.params import SamplingParamsError
from tests.engine.test_engine import TEXTS, tiny  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

REGEX = r"[ab]{2,4}-[0-9]"


def _greedy(llm: LLM, prompt, n: int, **extra) -> list[int]:
    params = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True, **extra)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def _absent(tokens: list[int]) -> int:
    return next(t for t in range(3, 500) if t not in tokens)


@pytest.mark.parametrize("settings", [{}, dict(async_scheduling=True)], ids=["plain", "async"])
def test_the_end_token_is_forced_when_the_budget_is_spent(tiny, settings):
    with LLM(tiny, dtype="float32", show_progress=False, num_kv_blocks=256, block_size=4, **settings) as llm:
        prompt = llm.engine.tokenizer(TEXTS[0]).input_ids
        free = _greedy(llm, prompt, 24)
        end = _absent(free)
        for budget in (0, 5):
            out = _greedy(llm, prompt, 16, thinking_token_budget=budget, reasoning_end_token_id=end)
            assert out[:budget] == free[:budget] and out[budget] == end  # the model's own, then the end
            # the answer is the model's continuation of what it was made to write
            assert out[budget + 1:] == _greedy(llm, prompt + out[:budget + 1], 16 - budget - 1)
        # a reasoning that ends by itself within the budget is never cut
        ends_itself = _greedy(llm, prompt, 16, thinking_token_budget=10, reasoning_end_token_id=free[3])
        assert ends_itself == free[:16]


def test_an_output_that_may_open_its_reasoning(tiny):
    """With an opening token the reasoning starts only at the first token: counted after it;
    an output that does not open it is never cut."""
    with LLM(tiny, dtype="float32", show_progress=False, num_kv_blocks=256, block_size=4) as llm:
        prompt = llm.engine.tokenizer(TEXTS[1]).input_ids
        free = _greedy(llm, prompt, 24)
        end = _absent(free)
        opened = _greedy(llm, prompt, 12, thinking_token_budget=4, reasoning_end_token_id=end,
                         reasoning_start_token_id=free[0])
        assert opened[:5] == free[:5] and opened[5] == end
        closed = _greedy(llm, prompt, 12, thinking_token_budget=4, reasoning_end_token_id=end,
                         reasoning_start_token_id=_absent(free + [end]))
        assert closed == free[:12]


def test_a_constraint_follows_the_forced_end(tiny):
    """With structured outputs too, the constraint takes the tokens after the forced end."""
    with LLM(tiny, dtype="float32", show_progress=False, num_kv_blocks=256, block_size=4) as llm:
        prompt = llm.engine.tokenizer(TEXTS[2]).input_ids
        free = _greedy(llm, prompt, 24)
        end = _absent(free)
        params = SamplingParams(max_new_tokens=30, temperature=0.0, thinking_token_budget=6, reasoning_end_token_id=end,
                                structured_outputs={"regex": REGEX})
        c = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert c.token_ids[:6] == free[:6] and c.token_ids[6] == end
        assert re.fullmatch(REGEX, llm.engine.tokenizer.decode(c.token_ids[7:], skip_special_tokens=True))
        sampled = SamplingParams(max_new_tokens=12, temperature=1.0, seed=3, n=3, thinking_token_budget=2,
                                 reasoning_end_token_id=end)
        for out in llm.generate(prompt, sampled, use_tqdm=False)[0].outputs:  # each sample its own count
            assert out.token_ids[2] == end or end in out.token_ids[:2]


def test_budget_settings_are_checked():
    with pytest.raises(SamplingParamsError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=4)  # no end token
    with pytest.raises(SamplingParamsError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1, reasoning_end_token_id=5)
    assert SamplingParams(thinking_token_budget=4, reasoning_end_token_id=5).needs_token_history
    state = ThinkingBudget(2, end_id=9)  # the output starts inside the reasoning
    state.advance(1, first=True)
    assert state.forced_token is None
    state.advance(2, first=False)
    assert state.forced_token == 9
    state.advance(9, first=False)
    assert state.done and state.forced_token is None
