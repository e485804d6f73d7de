"""SamplingParams: defaults, normalisation, and one named error per invalid value."""
from __future__ import annotations

import dataclasses
import math

import pytest

from tessera.sampling import SamplingParams, SamplingParamsError
from tessera.sampling.params import UNTIL_CONTEXT_ENDS


def test_defaults_and_greedy():
    p = SamplingParams()
    assert (p.max_new_tokens, p.temperature, p.top_k, p.top_p, p.seed) == (16, 1.0, 0, 1.0, None)
    assert not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.0).greedy


def test_top_k_minus_1_is_normalised_to_0():
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_token_ids_are_copied_into_a_list():
    source = (5, 6)
    p = SamplingParams(stop_token_ids=source)
    assert p.stop_token_ids == [5, 6] and isinstance(p.stop_token_ids, list)
    ids = [7]
    p = SamplingParams(stop_token_ids=ids)
    ids.append(8)
    assert p.stop_token_ids == [7]


@pytest.mark.parametrize("kwargs", [
    dict(max_new_tokens=1), dict(temperature=0.0), dict(temperature=5.0), dict(top_k=1),
    dict(top_k=0), dict(top_p=1.0), dict(top_p=1e-6), dict(seed=0), dict(seed=2**40),
])
def test_valid_edge_values_are_accepted(kwargs):
    p = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(p, name) == value


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", 0),
    ("max_new_tokens", -3),
    ("max_new_tokens", 2.0),
    ("max_new_tokens", "8"),
    ("temperature", -0.1),
    ("temperature", -math.inf),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.0001),
    ("top_p", math.nan),
    ("seed", 1.5),
    ("seed", "42"),
])
def test_invalid_value_raises_naming_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=f"`{field}`") as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)
    assert repr(value) in str(info.value)


def test_nan_temperature_is_rejected():
    with pytest.raises(SamplingParamsError, match="`temperature`"):
        SamplingParams(temperature=math.nan)


# --- the full parameter set ---------------------------------------------------------------------

def test_new_defaults_are_neutral():
    p = SamplingParams()
    assert (p.min_p, p.typical_p, p.repetition_penalty, p.frequency_penalty, p.presence_penalty) == \
        (0.0, 1.0, 1.0, 0.0, 0.0)
    assert (p.n, p.best_of, p.num_sequences, p.min_tokens, p.logprobs, p.prompt_logprobs, p.logit_bias) == \
        (1, None, 1, 0, None, None, None)
    assert p.stop == [] and not p.has_penalties and not p.needs_logprobs and p.do_sample is None


def test_max_tokens_and_min_new_tokens_are_aliases():
    assert SamplingParams(max_tokens=7).max_new_tokens == 7
    assert SamplingParams(max_new_tokens=7).max_tokens == 7
    assert SamplingParams(max_new_tokens=7, max_tokens=7).max_new_tokens == 7
    assert SamplingParams(7, max_tokens=7).max_new_tokens == 7
    assert SamplingParams(max_tokens=None).max_new_tokens == UNTIL_CONTEXT_ENDS  # vLLM: until the context is full
    assert SamplingParams(min_new_tokens=3).min_tokens == 3
    assert SamplingParams(min_tokens=3).min_new_tokens == 3
    with pytest.raises(SamplingParamsError, match="`max_new_tokens` and its alias `max_tokens`"):
        SamplingParams(max_new_tokens=7, max_tokens=8)
    with pytest.raises(SamplingParamsError, match="`min_tokens` and its alias `min_new_tokens`"):
        SamplingParams(min_tokens=1, min_new_tokens=2)
    with pytest.raises(SamplingParamsError, match="disagree: 5 != 6"):
        SamplingParams(5, max_tokens=6)


def test_errors_name_the_alias_the_caller_used():
    with pytest.raises(SamplingParamsError, match=r"^`max_tokens` must be an integer >= 1, got 0$"):
        SamplingParams(max_tokens=0)
    with pytest.raises(SamplingParamsError, match=r"^`min_new_tokens` must be an integer in \[0, max_new_tokens=4\]"):
        SamplingParams(max_tokens=4, min_new_tokens=9)
    with pytest.raises(SamplingParamsError, match=r"^`max_new_tokens` must be an integer >= 1"):
        SamplingParams(max_new_tokens=0)


def test_aliases_are_not_fields_so_replace_works():
    p = SamplingParams(max_tokens=7, min_new_tokens=2, n=2)
    assert "max_tokens" not in repr(p) and p == SamplingParams(max_new_tokens=7, min_tokens=2, n=2)
    q = dataclasses.replace(p, max_new_tokens=50, n=3, seed=4)
    assert (q.max_new_tokens, q.max_tokens, q.min_tokens, q.num_sequences, q.seed) == (50, 50, 2, 3, 4)
    with pytest.raises(SamplingParamsError, match="disagree"):
        dataclasses.replace(p, max_tokens=9)  # replace passes max_new_tokens=7 as well


def test_stop_accepts_a_string_or_a_list():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop=None).stop == []


def test_logit_bias_keys_may_be_json_strings():
    assert SamplingParams(logit_bias={"50": -100, 7: 2.5}).logit_bias == {50: -100.0, 7: 2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None


def test_best_of_defaults_to_n_and_children_get_consecutive_seeds():
    p = SamplingParams(n=3, seed=10)
    assert p.best_of is None and p.num_sequences == 3 and not p.needs_logprobs
    assert [p.child_seed(i) for i in range(3)] == [10, 11, 12]
    assert SamplingParams(n=2, best_of=4).needs_logprobs  # ranks its sequences
    assert SamplingParams(n=2).child_seed(1) is None
    assert SamplingParams(seed=2**64 - 1, n=2).child_seed(1) == 0


@pytest.mark.parametrize("kwargs, greedy", [
    (dict(), False),
    (dict(temperature=0), True),
    (dict(do_sample=False), True),                    # TGI: no warper set -> greedy
    (dict(do_sample=False, top_k=10), False),         # TGI: a warper turns sampling on
    (dict(do_sample=False, temperature=0.7), False),
    (dict(do_sample=False, typical_p=0.9), False),
    (dict(do_sample=True), False),
    (dict(temperature=0, top_p=0.5), True),           # temperature 0 wins
])
def test_greedy_or_sampled(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy


@pytest.mark.parametrize("kwargs", [
    dict(min_p=0.0), dict(min_p=1.0), dict(typical_p=1.0), dict(typical_p=0.01),
    dict(repetition_penalty=0.5), dict(repetition_penalty=5.0),
    dict(frequency_penalty=-2.0), dict(frequency_penalty=2.0), dict(presence_penalty=-2),
    dict(n=4), dict(n=2, best_of=5), dict(min_tokens=16), dict(logprobs=0), dict(logprobs=20),
    dict(prompt_logprobs=0), dict(seed=-5), dict(seed=2**64 - 1),
    dict(logit_bias={3: -100.0, 4: 100}), dict(stop=["a", "b"]), dict(include_stop_str_in_output=True),
])
def test_more_valid_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("field, value, kwargs, rule", [
    ("min_p", -0.1, {}, r"\[0, 1\]"),
    ("min_p", 1.5, {}, r"\[0, 1\]"),
    ("typical_p", 0.0, {}, r"\(0, 1\]"),
    ("typical_p", 1.2, {}, r"\(0, 1\]"),
    ("repetition_penalty", 0.0, {}, "> 0"),
    ("repetition_penalty", -1.0, {}, "> 0"),
    ("repetition_penalty", math.inf, {}, "> 0"),
    ("frequency_penalty", 2.5, {}, r"\[-2, 2\]"),
    ("frequency_penalty", math.nan, {}, r"\[-2, 2\]"),
    ("presence_penalty", -3.0, {}, r"\[-2, 2\]"),
    ("n", 0, {}, ">= 1"),
    ("n", 1.0, {}, ">= 1"),
    ("best_of", 1, dict(n=2), ">= n"),
    ("n", 2, dict(temperature=0.0), "greedy"),
    ("best_of", 3, dict(do_sample=False), "greedy"),
    ("min_tokens", -1, {}, r"\[0, max_new_tokens=16\]"),
    ("min_tokens", 20, {}, r"\[0, max_new_tokens=16\]"),
    ("logprobs", -1, {}, ">= 0"),
    ("logprobs", 2.0, {}, ">= 0"),
    ("prompt_logprobs", -3, {}, ">= 0"),
    ("seed", 2**64, {}, r"\[-2\*\*63, 2\*\*64\)"),
    ("seed", True, {}, "integer"),
    ("do_sample", "yes", {}, "true, false or null"),
    ("temperature", 0.0, dict(do_sample=True), "strictly positive"),
    ("ignore_eos", 1, {}, "true or false"),
    ("stop_token_ids", [3, -1], {}, "integers >= 0"),
    ("top_k", True, {}, "integer"),
])
def test_invalid_new_values_name_the_field_and_the_range(field, value, kwargs, rule):
    with pytest.raises(SamplingParamsError, match=f"`{field}`.*{rule}"):
        SamplingParams(**{field: value}, **kwargs)


@pytest.mark.parametrize("bias, match", [
    ({3: 101}, r"\[-100, 100\]"),
    ({3: "x"}, r"\[-100, 100\]"),
    ({-1: 1.0}, "token ids >= 0"),
    ({"abc": 1.0}, "token ids >= 0"),
    ([1, 2], "mapping"),
])
def test_invalid_logit_bias(bias, match):
    with pytest.raises(SamplingParamsError, match=f"`logit_bias`.*{match}"):
        SamplingParams(logit_bias=bias)


@pytest.mark.parametrize("stop", [[""], ["ok", 3], 5, [None]])
def test_invalid_stop(stop):
    with pytest.raises(SamplingParamsError, match="`stop` must be a string or a list of non-empty strings"):
        SamplingParams(stop=stop)
