"""`tessera generate` sampling flags: they reach SamplingParams, the JSONL output carries
logprobs and every completion, --stream prints the same text, bad values are errors."""
from __future__ import annotations

import json

import pytest

from tessera import LLM, SamplingParams
from tessera.cli import main

ENGINE_ARGS = ["--num-kv-blocks", "64", "--dtype", "float32"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


@pytest.fixture(scope="module")
def tiny(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=0)
    return folder


@pytest.fixture(scope="module")
def reference(tiny):
    return LLM(tiny, dtype="float32", num_kv_blocks=64, show_progress=False)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))


def test_sampling_flags_and_jsonl_logprobs(tiny, reference, tmp_path):
    out_file = tmp_path / "out.jsonl"
    code = main(["generate", "--model", str(tiny), *ENGINE_ARGS, "The quick", "--max-new-tokens", "6",
                 "--ignore-eos", "--repetition-penalty", "1.3", "--presence-penalty", "0.5",
                 "--logit-bias", "7=2.5", "--min-tokens", "2", "--logprobs", "2", "--prompt-logprobs", "1",
                 "--output-file", str(out_file)])
    assert code == 0
    (record,) = [json.loads(line) for line in out_file.read_text().splitlines()]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.5, logit_bias={7: 2.5}, min_tokens=2, logprobs=2,
                            prompt_logprobs=1)
    expected = reference.generate("The quick", params)[0]
    c = expected.outputs[0]
    assert record["token_ids"] == c.token_ids and record["text"] == c.text
    assert record["cumulative_logprob"] == pytest.approx(c.cumulative_logprob)
    assert len(record["logprobs"]) == 6
    first = record["logprobs"][0]
    chosen = c.logprobs[0][c.token_ids[0]]
    assert first[0]["token_id"] == c.token_ids[0] and first[0]["rank"] == chosen.rank
    assert first[0]["logprob"] == pytest.approx(chosen.logprob)
    assert [e["rank"] for e in first[1:]] == [1, 2]
    assert record["prompt_logprobs"][0] is None
    assert len(record["prompt_logprobs"]) == len(expected.prompt_token_ids)


def test_n_with_a_seed_prints_every_completion(tiny, reference, tmp_path, capsys):
    code = main(["generate", "--model", str(tiny), *ENGINE_ARGS, "Paged attention", "--max-new-tokens", "5",
                 "--ignore-eos", "--temperature", "0.9", "--n", "3", "--sample-seed", "4"])
    assert code == 0
    printed = capsys.readouterr().out
    expected = reference.generate("Paged attention", SamplingParams(
        temperature=0.9, n=3, seed=4, max_new_tokens=5, ignore_eos=True))[0]
    for c in expected.outputs:
        assert f"[{c.index}] {c.text}" in printed


def test_beam_search_prints_the_best_beams_first(tiny, reference, capsys):
    code = main(["generate", "--model", str(tiny), *ENGINE_ARGS, "Paged attention", "--max-new-tokens", "5",
                 "--beam-search", "--n", "2", "--best-of", "4", "--length-penalty", "0.5"])
    assert code == 0
    printed = capsys.readouterr().out
    expected = reference.generate("Paged attention", SamplingParams(
        use_beam_search=True, n=2, best_of=4, max_new_tokens=5, length_penalty=0.5))[0]
    assert printed.index(f"[0] {expected.outputs[0].text}") < printed.index(f"[1] {expected.outputs[1].text}")


def test_stop_and_stream(tiny, reference, capsys):
    full = reference.generate("Café", SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))[0]
    text = full.outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), "test setup: a visible stop string"
    code = main(["generate", "--model", str(tiny), *ENGINE_ARGS, "Café", "--max-new-tokens", "12",
                 "--ignore-eos", "--stop", stop, "--stream"])
    assert code == 0
    assert capsys.readouterr().out == text[:text.index(stop)] + "\n"


@pytest.mark.parametrize("flags, message", [
    (["--min-p", "1.5"], "`min_p` must be in [0, 1]"),
    (["--n", "2"], "`n` must be 1 when decoding is greedy"),
    (["--frequency-penalty", "3"], "`frequency_penalty` must be in [-2, 2]"),
])
def test_bad_sampling_flags_are_reported(tiny, capsys, flags, message):
    code = main(["generate", "--model", str(tiny), *ENGINE_ARGS, "hello", *flags])
    assert code == 2
    assert message in capsys.readouterr().err


def test_bad_logit_bias_syntax_and_stream_with_several_prompts(tiny):
    with pytest.raises(SystemExit, match="TOKEN_ID=BIAS"):
        main(["generate", "--model", str(tiny), *ENGINE_ARGS, "hello", "--logit-bias", "x"])
    with pytest.raises(SystemExit, match="--stream"):
        main(["generate", "--model", str(tiny), *ENGINE_ARGS, "a", "b", "--stream"])


def test_structured_output_flags(tiny, tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}},
                                  "required": ["ok"], "additionalProperties": False}))
    out_file = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(tiny), *ENGINE_ARGS, "The quick", "Paged", "--json-schema", str(schema),
                 "--max-new-tokens", "30", "--output-file", str(out_file)]) == 0
    for record in map(json.loads, out_file.read_text().splitlines()):
        assert json.loads(record["text"]).keys() == {"ok"}
    assert main(["generate", "--model", str(tiny), *ENGINE_ARGS, "The quick", "--choice", "left", "--choice", "right",
                 "--temperature", "1", "--n", "3", "--output-file", str(out_file)]) == 0
    (record,) = map(json.loads, out_file.read_text().splitlines())
    assert {c["text"] for c in record["completions"]} <= {"left", "right"}
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny), *ENGINE_ARGS, "The quick", "--regex", "[ab"]) == 2
    assert "invalid regex constraint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(tiny), "x", "--regex", "a", "--choice", "b"])  # one constraint


def test_unset_flags_take_the_models_generation_config(tiny, tmp_path):
    """As LLM.generate does (vLLM's --generation-config auto): the model's values for what
    the command line leaves out; the command line wins; `vllm` ignores the file."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "max_new_tokens": 3}))

    def tokens(*flags: str) -> int:
        out_file = tmp_path / "out.jsonl"
        assert main(["generate", "--model", str(folder), *ENGINE_ARGS, "The quick", "--ignore-eos",
                     "--output-file", str(out_file), *flags]) == 0
        (record,) = [json.loads(line) for line in out_file.read_text().splitlines()]
        return len(record["token_ids"])

    assert tokens() == 3
    assert tokens("--max-new-tokens", "5") == 5
    assert tokens("--generation-config", "vllm", "--max-new-tokens", "4") == 4
    assert tokens("--generation-config", "vllm") > 5  # the fallback (256, up to the context's end)
