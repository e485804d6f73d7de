"""Streaming detokenization and stop handling, end to end through the engine.

The model's choices are replaced by a script of token ids (the sampler runs, then its
output is overwritten), so that the text is known: stop strings spanning tokens, CJK and
emoji split across byte-level tokens, stop strings inside a token. Every streamed delta is
checked: no half characters, nothing of a stop string or after it, and the deltas add up
to the final text."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.engine.stop import find_stop, partial_stop_length

CJK = "你好世界 東京 🙂🎉 naïve"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


@pytest.fixture(scope="module")
def llm(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=0)
    llm = LLM(folder, dtype="float32", num_kv_blocks=128, block_size=4, show_progress=False)
    yield llm
    assert not llm.engine.has_unfinished() and llm.engine.block_manager.all_free()


@pytest.fixture
def script(llm, monkeypatch):
    """script(ids): every sequence's k-th generated token becomes ids[k]."""
    def install(ids: list[int]) -> None:
        sampler = llm.engine.runner.sampler
        original = sampler.sample

        def sample(logits, batch):
            out = original(logits, batch)
            forced = [ids[len(batch.output_ids(i))] for i in range(len(batch.params))]
            out.token_ids = torch.tensor(forced, device=out.token_ids.device)
            return out

        monkeypatch.setattr(sampler, "sample", sample)
    return install


def encode(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer(text, add_special_tokens=False).input_ids


def stream(llm: LLM, params: SamplingParams, prompt: str = "The quick") -> tuple[list[str], object]:
    """Run one request; returns its text deltas and its final CompletionOutput."""
    deltas, last = [], None
    for _, out in llm.generate_stream(prompt, params):
        (completion,) = out.outputs
        assert completion.delta_token_ids, "an output without a new token"
        deltas.append(completion.delta_text)
        # what was handed out so far is exactly the visible text so far
        assert completion.text == "".join(deltas)
        last = completion
    assert "".join(deltas) == last.text
    return deltas, last


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True, **kwargs)


# --- the pieces ---------------------------------------------------------------------------------

def test_find_stop_only_reports_matches_ending_in_the_new_text():
    assert find_stop("abc STOP", 4, ["STOP"]).start == 4
    assert find_stop("abc STOP", 1, ["STOP"]).start == 4   # the last char completes it
    assert find_stop("STOP abc", 3, ["STOP"]) is None      # ended before the new text
    assert find_stop("xx", 0, ["x"]) is None


def test_find_stop_takes_the_earliest_match():
    m = find_stop("one two three", 13, ["three", "o t", "two"])
    assert (m.stop, m.start) == ("two", 4)
    assert m.end(False) == 4 and m.end(True) == 7
    assert find_stop("aXYZ", 4, ["XY", "XYZ"]).stop == "XYZ"  # same start: the longer


@pytest.mark.parametrize("text, stops, held", [
    ("hello S", ["STOP"], 1), ("hello ST", ["STOP"], 2), ("hello STO", ["STOP"], 3),
    ("hello STOP", ["STOP"], 0),  # a whole stop is not held (it is matched instead)
    ("hello", ["STOP"], 0), ("abab", ["abc"], 2), ("aaa", ["aaab"], 3),
    ("x\n\n", ["\n\n\n", "\nEND"], 2), ("", ["a"], 0), ("🙂", ["🙂🎉"], 1),
])
def test_partial_stop_length(text, stops, held):
    assert partial_stop_length(text, stops) == held


# --- stop strings through the engine ------------------------------------------------------------

def test_stop_string_spanning_tokens_is_never_streamed(llm, script):
    ids = encode(llm, " brown fox STOP jumps over")
    script(ids)
    deltas, out = stream(llm, greedy(len(ids), stop=["STOP"]))
    assert len(encode(llm, "STOP")) > 1, "test setup: the stop should span tokens"
    assert out.text == " brown fox "
    assert out.finish_reason == "stop_sequence" and out.stop_reason == "STOP"
    assert all("S" not in d for d in deltas)
    stop_end = len(encode(llm, " brown fox STOP"))
    assert out.token_ids == ids[:stop_end]  # generation ended at the token completing it


def test_stop_string_included_when_asked(llm, script):
    ids = encode(llm, " brown fox STOP jumps over")
    script(ids)
    _, out = stream(llm, greedy(len(ids), stop=["STOP"], include_stop_str_in_output=True))
    assert out.text == " brown fox STOP"
    assert out.finish_reason == "stop_sequence"


def test_text_after_a_stop_inside_the_same_token_is_trimmed(llm, script):
    ids = encode(llm, " quick brown fox")
    pieces = [llm.tokenizer.decode([i]) for i in ids]
    long_piece = next(p for p in pieces if len(p.strip()) >= 3)
    stop = long_piece[:-1]  # ends one character before the end of its token
    script(ids)
    _, out = stream(llm, greedy(len(ids), stop=[stop]))
    full = llm.tokenizer.decode(ids)
    assert out.text == full[:full.index(stop)]
    _, out = stream(llm, greedy(len(ids), stop=[stop], include_stop_str_in_output=True))
    assert out.text == full[:full.index(stop) + len(stop)]


def test_a_partial_stop_that_does_not_complete_is_released(llm, script):
    ids = encode(llm, " ST STO STOP? no: S T O P")
    script(ids)
    deltas, out = stream(llm, greedy(len(ids), stop=["STOP!"]))
    assert out.text == " ST STO STOP? no: S T O P" and out.finish_reason == "length"
    assert deltas[-1] != ""  # a held "S" or "P" comes out at the end


def test_earliest_of_several_stops_wins_and_the_prompt_is_not_searched(llm, script):
    ids = encode(llm, " one two three four")
    script(ids)
    _, out = stream(llm, greedy(len(ids), stop=["four", "two", "The"]), prompt="The quick")
    assert out.text == " one " and out.stop_reason == "two"


def test_stop_strings_wait_for_min_tokens(llm, script):
    ids = encode(llm, " a STOP b STOP c")
    script(ids)
    first_stop_end = len(encode(llm, " a STOP"))
    _, out = stream(llm, greedy(len(ids), stop=["STOP"], min_tokens=first_stop_end + 1))
    assert out.text == " a STOP b "


def test_stop_token_text_is_left_out_unless_included(llm, script):
    ids = encode(llm, " brown fox jumps")
    script(ids)
    stop_token = ids[2]
    _, out = stream(llm, greedy(10, stop_token_ids=[stop_token]))
    assert out.token_ids == ids[:3] and out.stop_reason == stop_token
    assert out.text == llm.tokenizer.decode(ids[:2])
    _, out = stream(llm, greedy(10, stop_token_ids=[stop_token], include_stop_str_in_output=True))
    assert out.text == llm.tokenizer.decode(ids[:3])


# --- multi-byte characters ----------------------------------------------------------------------

def test_cjk_and_emoji_stream_whole_characters_only(llm, script):
    ids = encode(llm, CJK)
    pieces = [llm.tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "test setup: some characters should span tokens"
    script(ids)
    deltas, out = stream(llm, greedy(len(ids)))
    assert out.text == CJK
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0  # steps that ended inside a character


def test_stop_string_of_split_emoji(llm, script):
    ids = encode(llm, CJK)
    script(ids)
    deltas, out = stream(llm, greedy(len(ids), stop=["🎉"]))
    assert out.text == "你好世界 東京 🙂"
    assert all("\ufffd" not in d for d in deltas)


def test_length_limit_inside_a_character_flushes_a_replacement_char(llm, script):
    ids = encode(llm, "🙂🎉")
    script(ids)
    n = next(k for k in range(1, len(ids)) if llm.tokenizer.decode(ids[:k]).endswith("\ufffd"))
    _, out = stream(llm, greedy(n))
    assert out.text.endswith("\ufffd") and out.finish_reason == "length"


# --- the streaming API --------------------------------------------------------------------------

def test_generate_stream_interleaves_prompts_and_each_ends_once(llm):
    params = [greedy(6), greedy(3), SamplingParams(temperature=0.8, seed=1, max_new_tokens=5, ignore_eos=True)]
    prompts = ["The quick", "Paged attention", "Café"]
    seen: dict[int, list] = {0: [], 1: [], 2: []}
    finished = []
    for index, out in llm.generate_stream(prompts, params):
        seen[index].append(out.outputs[0].delta_token_ids)
        if out.finished:
            finished.append(index)
    assert sorted(finished) == [0, 1, 2]
    assert [len(seen[i]) for i in range(3)] == [6, 3, 5]
    expected = llm.generate(prompts, params)
    for i in range(3):
        assert sum(seen[i], []) == expected[i].outputs[0].token_ids


def test_closing_a_stream_early_aborts_its_requests(llm):
    gen = llm.generate_stream(["The quick", "Paged attention"], greedy(30))
    next(gen)
    assert llm.engine.has_unfinished()
    gen.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.block_manager.all_free() and llm.engine.requests == {}


def test_iter_outputs_leaves_other_requests_running(llm):
    engine = llm.engine
    engine.add_request("short", "The quick", greedy(2))
    engine.add_request("long", "Paged attention", greedy(8))
    outs = list(engine.iter_outputs(["short"]))
    assert {o.request_id for o in outs} == {"short"} and outs[-1].finished
    assert "long" in engine.requests
    rest = list(engine.iter_outputs())
    assert rest[-1].request_id == "long" and rest[-1].finished
    assert len(rest[-1].outputs[0].token_ids) == 8


def test_final_only_steps_report_finished_requests_with_the_same_outputs(llm):
    """step(stream=False), what offline generate uses: no output for a request until it
    finishes, then the same one a streaming step gives."""
    engine = llm.engine
    prompts = {"a": ("The quick", 3), "b": ("Paged attention", 7), "c": ("def fib", 5)}
    for request_id, (prompt, n) in prompts.items():
        engine.add_request(request_id, prompt, greedy(n))
    finals = []
    while engine.has_unfinished():
        outs = engine.step(stream=False)
        assert all(o.finished for o in outs)
        finals += outs
    assert sorted(o.request_id for o in finals) == ["a", "b", "c"]
    for out in finals:
        prompt, n = prompts[out.request_id]
        (want,) = llm.generate([prompt], greedy(n))
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert out.outputs[0].text == want.outputs[0].text
        assert out.outputs[0].finish_reason == want.outputs[0].finish_reason == "length"


# --- the default model's tokenizer (SmolLM2's byte-level BPE, 49k tokens) ------------------------

@pytest.fixture(scope="module")
def smollm_tokenizer():
    from tessera.config import ModelConfig
    from tessera.models.registry import get_router

    return get_router(ModelConfig()).tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("text, stop", [
    ("日本語のテキスト、中文文本和 emoji 👩‍👩‍👧‍👦🇫🇷🙂 mixed.", None),
    ("Prices: 5€ → 10€; naïve café ☕ done", "☕"),
    ("你好，世界！再见。", "世界"),
])
def test_default_tokenizer_streams_whole_characters_and_stops(smollm_tokenizer, text, stop):
    from tessera.engine.output_processor import OutputProcessor
    from tessera.engine.sequence import Sequence

    tok = smollm_tokenizer
    ids = tok(text, add_special_tokens=False).input_ids
    assert any("\ufffd" in tok.decode([i]) for i in ids), "test setup: multi-token characters"
    params = SamplingParams(max_new_tokens=len(ids), ignore_eos=True, stop=stop)
    seq = Sequence("r", None, tok("Say:", add_special_tokens=False).input_ids, params, 10_000)
    processor = OutputProcessor(tok, frozenset({tok.eos_token_id}))
    deltas = []
    for token in ids:
        deltas.append(processor.append_token(seq, token, None)[0])
        if seq.finish_reason is not None:
            break
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == seq.output_text
    expected = text if stop is None else text[:text.index(stop)]
    assert seq.output_text == expected
    assert seq.finish_reason.value == ("length" if stop is None else "stop_sequence")


@pytest.mark.slow
def test_fast_decoder_equals_the_tokenizers_decode(smollm_tokenizer, tiny_tokenizer_dir):
    """The detokenizer decodes through the Rust backend where transformers' decode would
    return the same text: checked on random id windows (special tokens included, skipped
    or not) for the default tokenizer and the tests' tiny one; a tokenizer that cleans up
    spaces keeps transformers' decode."""
    import random

    from transformers import AutoTokenizer

    from tessera.engine.detokenizer import fast_decoder

    rng = random.Random(0)
    for tok in (smollm_tokenizer, AutoTokenizer.from_pretrained(tiny_tokenizer_dir)):
        decode = fast_decoder(tok)
        specials = tok.all_special_ids
        for _ in range(300):
            ids = [rng.choice(specials) if rng.random() < 0.1 else rng.randrange(len(tok))
                   for _ in range(rng.randrange(0, 12))]
            for skip in (False, True):
                assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip), (ids, skip)
    calls = []
    cleaning = AutoTokenizer.from_pretrained(tiny_tokenizer_dir, clean_up_tokenization_spaces=True)
    cleaning.decode = lambda ids, skip_special_tokens: calls.append(ids) or ""
    fast_decoder(cleaning)([5, 6], False)

    class Overriding(type(cleaning)):  # a tokenizer class with its own decoding
        def _decode(self, token_ids, **kwargs):
            calls.append(token_ids)
            return ""

    fast_decoder(Overriding.from_pretrained(tiny_tokenizer_dir))([7], False)
    assert calls == [[5, 6], [7]]
