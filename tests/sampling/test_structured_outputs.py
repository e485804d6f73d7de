"""Structured outputs through the engine on a tiny random llama: whatever the random model
prefers, the text follows the JSON schema / regex / choice / grammar, greedy or sampled, with
n > 1, under preemption and with async scheduling; a bad constraint is a RequestError that
queues nothing."""
from __future__ import annotations

import json
import re

import pytest

from tessera import LLM, SamplingParams
from tessera.engine.engine import RequestError
from tessera.sampling.params import SamplingParamsError
from tessera.sampling.structured import StructuredOutputsParams
from tests.engine.test_engine import TEXTS, tiny  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest

SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "tag", "n"], "additionalProperties": False}


def valid_against_schema(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"ok", "tag", "n"} and isinstance(value["ok"], bool)
            and value["tag"] in ("red", "green", "blue") and isinstance(value["n"], int) and 0 <= value["n"] <= 99)


CASES = [
    ({"json": SCHEMA}, valid_against_schema),
    ({"json": json.dumps(SCHEMA)}, valid_against_schema),
    ({"regex": r"[ab]{2,4}-[0-9]"}, lambda t: re.fullmatch(r"[ab]{2,4}-[0-9]", t) is not None),
    ({"choice": ["yes", "no", 'a "quoted" café']}, lambda t: t in ("yes", "no", 'a "quoted" café')),
    ({"grammar": 'root ::= "(" xy xy? xy? ")"\nxy ::= "x" | "y"'},
     lambda t: re.fullmatch(r"\((x|y){1,3}\)", t) is not None),
]


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(tiny, dtype="float32", show_progress=False, num_kv_blocks=256, block_size=4) as llm:
        yield llm
        assert llm.engine.block_manager.all_free() and not llm.engine.requests


@pytest.mark.parametrize("spec,valid", CASES, ids=["schema", "schema-text", "regex", "choice", "grammar"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_follows_its_constraint(llm, spec, valid, temperature):
    params = SamplingParams(max_new_tokens=60, temperature=temperature, seed=7, structured_outputs=spec)
    for out in llm.generate(TEXTS[:4], params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "eos_token", c.text  # the constraint completed and ended it
        assert valid(c.text), c.text


def test_unconstrained_output_of_the_same_model_does_not_follow_it(llm):
    """The test above is not vacuous: the random model alone does not write these."""
    text = llm.generate(TEXTS[0], SamplingParams(max_new_tokens=20, temperature=0.0))[0].outputs[0].text
    assert not any(valid(text) for _, valid in CASES[2:])


def test_json_object_is_any_json_object(llm):
    out = llm.generate(TEXTS[:2], SamplingParams(max_new_tokens=200, temperature=0.0,
                                                 structured_outputs={"json_object": True}))
    for o in out:
        if o.outputs[0].finish_reason == "eos_token":
            assert isinstance(json.loads(o.outputs[0].text), dict)
        else:  # cut at max_tokens: still a prefix of an object
            assert o.outputs[0].text.startswith("{")


def test_each_of_n_sequences_has_its_own_matcher(llm):
    params = SamplingParams(n=3, max_new_tokens=40, temperature=1.0, seed=3, structured_outputs={"json": SCHEMA})
    texts = [c.text for c in llm.generate(TEXTS[0], params)[0].outputs]
    assert len(texts) == 3 and all(valid_against_schema(t) for t in texts)


@pytest.mark.parametrize("settings", [dict(num_kv_blocks=20), dict(async_scheduling=True)],
                         ids=["preemption", "async"])
def test_constraints_hold_under_preemption_and_async_scheduling(tiny, settings):
    expected_llm = LLM(tiny, dtype="float32", show_progress=False, num_kv_blocks=256, block_size=4)
    llm = LLM(tiny, dtype="float32", show_progress=False, block_size=4, **{"num_kv_blocks": 256, **settings})
    params = [SamplingParams(max_new_tokens=40, temperature=0.8, seed=i, structured_outputs=spec)
              for i, (spec, _) in enumerate(CASES * 2)]
    prompts = (TEXTS * 2)[:len(params)]
    want = [o.outputs[0].text for o in expected_llm.generate(prompts, params)]
    got = [o.outputs[0].text for o in llm.generate(prompts, params)]
    assert got == want
    assert all(valid(t) for t, (_, valid) in zip(got, CASES * 2))
    if "num_kv_blocks" in settings:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.all_free()


@pytest.mark.parametrize("spec,message", [
    ({"regex": "[ab"}, "invalid regex constraint"),
    ({"json": '{"type": "object", "properties": '}, "invalid json constraint"),
    ({"grammar": "root ::= undefined_rule"}, "invalid grammar constraint"),
])
def test_a_constraint_that_does_not_compile_is_a_request_error(llm, spec, message):
    with pytest.raises(RequestError, match=message):
        llm.engine.add_request("bad", TEXTS[0], SamplingParams(structured_outputs=spec))
    assert "bad" not in llm.engine.requests and not llm.engine.has_unfinished()


@pytest.mark.parametrize("spec", [{}, {"json": SCHEMA, "regex": "a"}, {"choice": []}, {"choice": "yes"},
                                  {"json": 3}, {"regex": 1}, {"schema": SCHEMA}])
def test_malformed_specs_are_sampling_params_errors(spec):
    with pytest.raises(SamplingParamsError):
        SamplingParams(structured_outputs=spec)
    assert SamplingParams(structured_outputs=StructuredOutputsParams(regex="a")).structured_outputs.kind == "regex"


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_gives_way_to_a_complete_constraint(tiny, async_scheduling):
    """A choice is complete after one word, where only EOS may follow; min_tokens would
    forbid EOS and leave nothing to choose. The constraint wins, and a neighbour in the
    same batch is untouched."""
    llm = LLM(tiny, dtype="float32", show_progress=False, num_kv_blocks=256, block_size=4,
              async_scheduling=async_scheduling)
    plain = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    alone = llm.generate(TEXTS[1], plain)[0].outputs[0].token_ids
    constrained = SamplingParams(max_new_tokens=20, temperature=0.0, min_tokens=8,
                                 structured_outputs={"choice": ["yes", "no"]})
    first, second = llm.generate([TEXTS[0], TEXTS[1]], [constrained, plain])
    assert first.outputs[0].text in ("yes", "no") and first.outputs[0].finish_reason == "eos_token"
    assert second.outputs[0].token_ids == alone
    assert llm.engine.block_manager.all_free()


@pytest.mark.parametrize("spec", [{"regex": r"[^\s\S]"}, {"grammar": 'root ::= root "x"'}])
def test_a_constraint_that_matches_nothing_is_refused_up_front(llm, spec):
    with pytest.raises(RequestError, match="matches nothing"):
        llm.engine.add_request("nothing", TEXTS[0], SamplingParams(structured_outputs=spec))
    assert not llm.engine.has_unfinished()


def test_a_constraint_that_dead_ends_finishes_only_its_own_request(llm):
    """'a' is allowed first, then the rule after it can never produce anything: that request
    ends (abort) and the step, and the request beside it, go on."""
    dead_end = SamplingParams(max_new_tokens=10, temperature=0.0,
                              structured_outputs={"grammar": 'root ::= "a" tail\ntail ::= tail "b"'})
    plain = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    try:
        first, second = llm.generate([TEXTS[0], TEXTS[1]], [dead_end, plain])
    except RequestError:
        pytest.skip("xgrammar refuses this grammar at compile time")
    assert first.outputs[0].finish_reason == "abort" and first.outputs[0].text in ("", "a")
    assert len(second.outputs[0].token_ids) == 6 and second.outputs[0].finish_reason == "length"
