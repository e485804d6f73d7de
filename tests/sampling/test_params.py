"""SamplingParams: defaults, normalisation, and one named error per invalid value."""
from __future__ import annotations

import math

import pytest

from tessera.sampling import SamplingParams, SamplingParamsError


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
