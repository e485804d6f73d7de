"""`tessera generate --watermark` and `tessera detect-watermark`: the command line's
watermark settings (flags and TGI's variables) reach the engine, the generated JSONL is
read back exactly (token ids, chat prompts' ids), and the detector's verdicts and errors."""
from __future__ import annotations

import dataclasses
import json

import pytest

from tessera import LLM, SamplingParams
from tessera.cli import build_parser, main
from tessera.config import WatermarkConfig
from tessera.sampling.watermark import detect_watermark

ENGINE_ARGS = ["--num-kv-blocks", "64", "--dtype", "float32"]
PROMPTS = ["The quick brown fox", "Paged attention stores"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


@pytest.fixture(scope="module")
def tiny(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=0)
    return folder


def test_watermark_settings_come_from_flags_then_tgi_variables(monkeypatch):
    args = build_parser().parse_args(["generate", "hi"])
    assert (args.watermark_gamma, args.watermark_delta, args.watermark_key) == (0.5, 2.0, 15485863)
    monkeypatch.setenv("WATERMARK_GAMMA", "0.25")
    monkeypatch.setenv("WATERMARK_DELTA", "1.5")
    monkeypatch.setenv("TESSERA_WATERMARK_KEY", "99")
    args = build_parser().parse_args(["serve"])
    assert (args.watermark_gamma, args.watermark_delta, args.watermark_key) == (0.25, 1.5, 99)
    args = build_parser().parse_args(["detect-watermark", "--watermark-gamma", "0.3", "x"])
    assert args.watermark_gamma == 0.3


def test_generated_jsonl_is_detected_and_plain_output_is_not(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    flags = ["--watermark-delta", "5", "--watermark-key", "4242"]
    common = ["--model", str(tiny), *ENGINE_ARGS, "--input-file", str(prompts), "--max-new-tokens", "48",
              "--ignore-eos", "--temperature", "1", "--sample-seed", "1", "--chat", *flags]
    assert main(["generate", *common, "--watermark", "--output-file", str(tmp_path / "marked.jsonl")]) == 0
    # any file name: the detector tells JSONL by its lines, not its suffix
    assert main(["generate", *common, "--output-file", str(tmp_path / "plain.json")]) == 0
    records = [json.loads(line) for line in (tmp_path / "marked.jsonl").read_text().splitlines()]
    with LLM(tiny, dtype="float32", num_kv_blocks=64, show_progress=False) as llm:
        chat_ids = llm.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])
    assert records[0]["prompt_token_ids"] == chat_ids  # the template's ids, not the user text's
    capsys.readouterr()

    for name, expected in (("marked.jsonl", True), ("plain.json", False)):
        assert main(["detect-watermark", "--model", str(tiny), *flags, "--json",
                     "--input-file", str(tmp_path / name)]) == 0
        scores = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert len(scores) == 2
        records = [json.loads(line) for line in (tmp_path / name).read_text().splitlines()]
        for score, record in zip(scores, records):
            assert score["prediction"] is expected, score
            # every token, the first seeded by the chat prompt's last id
            exact = detect_watermark(record["prompt_token_ids"][-1:] + record["token_ids"], 512,
                                     WatermarkConfig(delta=5.0, key=4242))
            assert score == dataclasses.asdict(exact) and exact.num_tokens_scored == 48
    # another key sees no watermark
    assert main(["detect-watermark", "--model", str(tiny), "--watermark-key", "1", "--json",
                 "--input-file", str(tmp_path / "marked.jsonl")]) == 0
    assert not any(json.loads(line)["prediction"] for line in capsys.readouterr().out.splitlines())


def test_texts_files_and_errors(tiny, tmp_path, capsys):
    assert main(["detect-watermark", "--model", str(tiny),
                 "The quick brown fox jumps over the lazy dog."]) == 0
    out = capsys.readouterr().out
    assert out.startswith("not watermarked: z = ") and "50% expected" in out
    text = tmp_path / "text.txt"
    text.write_text("Continuous batching lets requests join between steps.")
    assert main(["detect-watermark", "--model", str(tiny), "--input-file", str(text), "--json",
                 "--z-threshold", "-100"]) == 0
    score = json.loads(capsys.readouterr().out)
    assert score["prediction"] is True and score["z_threshold"] == -100  # the threshold is the user's
    # one text too short to score: reported, the others still scored, exit 1
    assert main(["detect-watermark", "--model", str(tiny), "--json", "a", "The quick brown fox jumps"]) == 1
    first, second = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert "at least 2 tokens" in first["error"] and "z_score" in second
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok text"}\n{"other": 1}\n')
    assert main(["detect-watermark", "--model", str(tiny), "--input-file", str(bad)]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
    assert main(["detect-watermark", "--model", str(tiny), "--input-file", str(text), "more text"]) == 2
    assert "not both" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["detect-watermark", "--watermark-gamma", "x", "hi"])
    with pytest.raises(SystemExit):
        main(["detect-watermark", "--watermark-key", "my-secret-key", "hi"])
    err = capsys.readouterr().err
    assert "--watermark-key: must be an integer" in err and "my-secret-key" not in err
    assert main(["detect-watermark", "--model", str(tiny), "--watermark-gamma", "1.5", "hi there"]) == 2
    assert "gamma" in capsys.readouterr().err


def test_generate_watermark_flag_equals_the_llm_api(tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    config = WatermarkConfig(gamma=0.25, delta=3.0)
    with LLM(tiny, dtype="float32", num_kv_blocks=64, show_progress=False, watermark=config) as llm:
        expected = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True,
                                                           watermark=True))[0].outputs[0].text
    assert main(["generate", "--model", str(tiny), *ENGINE_ARGS, "--max-new-tokens", "16", "--ignore-eos",
                 "--watermark", "--watermark-gamma", "0.25", "--watermark-delta", "3", PROMPTS[0]]) == 0
    assert capsys.readouterr().out == expected + "\n"
