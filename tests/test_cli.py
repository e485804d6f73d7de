"""`tessera generate` and `tessera models`: a real process for the main paths, main() in
process for the rest. Outputs are compared with the LLM API on the same tiny model."""
from __future__ import annotations

import json
import os
import subprocess
import sys

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


def run_cli(*args: str, cache_dir) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TESSERA_CACHE_DIR=str(cache_dir),
               TOKENIZERS_PARALLELISM="false")
    return subprocess.run([sys.executable, "-m", "tessera.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_generate_one_prompt_prints_the_generated_text(tiny, reference, tmp_path):
    proc = run_cli("generate", "--model", str(tiny), *ENGINE_ARGS, "--max-new-tokens", "4", "hello",
                   cache_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr
    expected = reference.generate("hello", SamplingParams(temperature=0.0, max_new_tokens=4))[0]
    assert proc.stdout == expected.outputs[0].text + "\n"
    n = len(expected.outputs[0].token_ids)
    assert f"[1 prompts, {n} tokens generated in" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_missing_model_path_exits_non_zero_with_a_clear_message(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = run_cli("generate", "--model", str(missing), *ENGINE_ARGS, "hello", cache_dir=tmp_path)
    assert proc.returncode != 0
    assert f"error: model '{missing}' is not a local folder or .gguf file" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_input_file_jsonl_with_output_file(tiny, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    messages = [{"role": "user", "content": "Paged attention"}]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join([
        json.dumps("The quick brown fox"),
        "",
        json.dumps({"prompt": "Café, naïve"}),
        json.dumps({"messages": messages}),
    ]) + "\n")
    out_file = tmp_path / "out.jsonl"
    code = main(["generate", "--model", str(tiny), *ENGINE_ARGS, "--max-new-tokens", "5",
                 "--ignore-eos", "--input-file", str(prompts), "--output-file", str(out_file),
                 "hello"])
    assert code == 0
    records = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["hello", "The quick brown fox", "Café, naïve", messages]
    params = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
    expected = reference.generate(["hello", "The quick brown fox", "Café, naïve"], params)
    expected.append(reference.chat(messages, params)[0])
    for record, exp in zip(records, expected):
        assert record["token_ids"] == exp.outputs[0].token_ids
        assert len(record["token_ids"]) == 5
        assert record["text"] == exp.outputs[0].text
        assert record["finish_reason"] == "length"


def test_input_file_of_plain_lines_prints_each_prompt_and_output(tiny, reference, tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond one\n")
    code = main(["generate", "--model", str(tiny), *ENGINE_ARGS, "--max-new-tokens", "3",
                 "--input-file", str(prompts)])
    assert code == 0
    out = capsys.readouterr().out
    expected = reference.generate(["first prompt", "second one"],
                                  SamplingParams(temperature=0.0, max_new_tokens=3))
    assert out == "".join(f"### {p}\n{e.outputs[0].text}\n\n"
                          for p, e in zip(["first prompt", "second one"], expected))


@pytest.mark.parametrize("line, message", [
    ("{not json", "prompts.jsonl:2: not valid JSON"),
    ("42", "prompts.jsonl:2: expected a string"),
    ('{"text": "x"}', "prompts.jsonl:2: expected a string"),
])
def test_bad_jsonl_line_is_reported_with_its_line_number(tmp_path, line, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps("ok") + "\n" + line + "\n")
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(tmp_path / "unused"), "--input-file", str(prompts)])
    assert message in str(info.value.code)


def test_no_prompt_at_all_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="give a prompt"):
        main(["generate", "--model", str(tmp_path)])
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(SystemExit, match="holds no prompts"):
        main(["generate", "--input-file", str(empty)])


def test_invalid_sampling_option_exits_2_naming_it(tmp_path, capsys):
    code = main(["generate", "--model", str(tmp_path), "--top-p", "0", "hello"])
    assert code == 2
    assert "error: `top_p` must be in (0, 1]" in capsys.readouterr().err


def test_models_lists_llama(capsys):
    assert main(["models"]) == 0
    assert "llama" in capsys.readouterr().out.split()


def test_scheduler_limits_default_per_device_and_keep_what_is_given():
    from tessera.config import scheduler_defaults
    from tessera.llm import engine_config

    assert scheduler_defaults("cpu") == (64, 1024)
    assert scheduler_defaults("cuda:1") == (256, 8192)
    assert scheduler_defaults("cpu", 2048) == (2048, 2048)  # the default budget holds every row
    assert scheduler_defaults("cuda", 16, 512) == (16, 512)
    assert scheduler_defaults("cpu", None, 4096) == (64, 4096)
    cfg = engine_config(None, device="cuda").scheduler
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (256, 8192)


def test_serve_takes_the_serving_token_budget_unless_told(monkeypatch):
    from tessera import cli
    from tessera.config import scheduler_defaults
    from tessera.server import serve
    from tessera.weights import source

    assert scheduler_defaults("cpu", serving=True) == (64, 256)
    assert scheduler_defaults("cpu", 512, serving=True) == (512, 512)
    assert scheduler_defaults("cpu", None, 2048, serving=True) == (64, 2048)
    assert scheduler_defaults("cuda", serving=True) == (256, 8192)
    seen = []
    monkeypatch.setattr(serve, "run_server", lambda make_engine, **kwargs: 0)
    monkeypatch.setattr(cli, "engine_config_from_args", lambda args: seen.append(
        (args.batch_size, args.max_num_batched_tokens, args.no_chunked_prefill)))
    monkeypatch.setattr(cli, "serve_rank_if_not_driver", lambda config: False)
    monkeypatch.setattr(source, "resolve_model_source", lambda model: type("Source", (), {"name": "m"}))
    for extra in ([], ["--max-num-batched-tokens", "1024"], ["--no-chunked-prefill"]):
        assert cli.main(["serve", *extra]) == 0
    assert seen == [(64, 256, False), (64, 1024, False), (None, None, True)]


def test_device_auto_is_resolved_before_the_devices_defaults(monkeypatch):
    """On a machine where torch sees a GPU, a plain `tessera serve` runs on it with CUDA's
    scheduler limits; `--[no-]async-scheduling` left out is None (the device decides)."""
    from tessera import cli
    from tessera.server import serve
    from tessera.weights import source
    from tests.test_platform import fake_gpus

    seen = []
    fake_gpus(monkeypatch, [(9, 0)])
    monkeypatch.setattr(serve, "run_server", lambda make_engine, **kwargs: 0)
    monkeypatch.setattr(cli, "engine_config_from_args", lambda args: seen.append(
        (args.device, args.batch_size, args.max_num_batched_tokens, args.async_scheduling)))
    monkeypatch.setattr(cli, "serve_rank_if_not_driver", lambda config: False)
    monkeypatch.setattr(source, "resolve_model_source", lambda model: type("Source", (), {"name": "m"}))
    for extra in ([], ["--device", "cpu", "--no-async-scheduling"], ["--async-scheduling"]):
        assert cli.main(["serve", *extra]) == 0
    assert seen == [("cuda", 256, 8192, None), ("cpu", 64, 256, False), ("cuda", 256, 8192, True)]


def test_serve_tool_call_parser_choices_are_the_servers_parsers():
    from tessera.cli import TOOL_CALL_PARSERS
    from tessera.server.tool_parsers import PARSERS

    assert set(TOOL_CALL_PARSERS) == set(PARSERS)


def test_serve_reasoning_parser_choices_are_the_servers_parsers(monkeypatch):
    from tessera import cli
    from tessera.server import reasoning

    assert set(cli.REASONING_PARSERS) == set(reasoning.REASONING_PARSERS)
    seen = {}
    monkeypatch.setattr("tessera.server.serve.run_server", lambda make, **kwargs: seen.update(kwargs) or 0)
    assert cli.main(["serve", "--reasoning-parser", "qwen3"]) == 0
    assert seen["reasoning_parser"] == "qwen3"


def test_generate_with_speculative_decoding_gives_the_plain_output(tiny, reference, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    expected = reference.generate("The quick brown fox", params)[0].outputs[0].text
    for flags in (["--speculate", "3"],
                  ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}']):
        code = main(["generate", "--model", str(tiny), *ENGINE_ARGS, "--max-new-tokens", "24", "--ignore-eos",
                     *flags, "The quick brown fox"])
        assert code == 0
        assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("flags, message", [
    (["--speculate", "2", "--speculative-config", '{"num_speculative_tokens": 2}'], "not both"),
    (["--speculative-config", "{num_speculative_tokens: 2}"], "not JSON"),
    (["--speculative-config", "[2]"], "JSON object"),
])
def test_bad_speculative_flags_exit_with_a_message(tiny, flags, message):
    with pytest.raises(SystemExit, match=message):
        main(["generate", "--model", str(tiny), *ENGINE_ARGS, *flags, "hello"])


def test_unknown_speculative_config_key_exits_2(tiny, capsys):
    code = main(["generate", "--model", str(tiny), *ENGINE_ARGS, "--speculative-config",
                 '{"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}', "hello"])
    assert code == 2
    assert "unknown speculative_config keys ['draft_tensor_parallel_size']" in capsys.readouterr().err


def test_a_missing_draft_model_exits_2_before_any_weights_load(tiny, tmp_path, capsys):
    code = main(["generate", "--model", str(tiny), *ENGINE_ARGS, "--speculative-config",
                 f'{{"num_speculative_tokens": 2, "model": "{tmp_path / "nowhere"}"}}', "hello"])
    assert code == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "Loading weights" not in err


def test_generate_with_a_lora_module_gives_the_adapters_output(tiny, tmp_path, monkeypatch, capsys):
    from tests.server.test_lora_http import save_adapter
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TESSERA_CACHE_DIR", str(tmp_path / "cache"))
    path = save_adapter(AutoModelForCausalLM.from_pretrained(tiny), tmp_path / "sql", 3, ["q_proj", "down_proj"])
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    with LLM(tiny, dtype="float32", num_kv_blocks=64, show_progress=False, enable_lora=True,
             lora_modules={"sql": path}) as llm:
        expected = llm.generate("The quick brown fox", params, lora_request="sql")[0].outputs[0].text
        assert expected != llm.generate("The quick brown fox", params)[0].outputs[0].text
    for flags in (["--lora-modules", f"sql={path}"], ["--lora-modules", json.dumps({"name": "sql", "path": path})],
                  ["--lora-adapters", f"other={path}, sql={path}"]):  # TGI's comma-separated form
        code = main(["generate", "--model", str(tiny), *ENGINE_ARGS, "--max-new-tokens", "12", "--ignore-eos",
                     *flags, "--lora", "sql", "The quick brown fox"])
        assert code == 0
        assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize("flags, message", [
    (["--lora-modules", "sql"], "expected NAME=PATH"),
    (["--lora-adapters", "predibase/dbpedia"], "expected NAME=PATH"),
    (["--lora-modules", '{"name": "sql"}'], "JSON form"),
    (["--lora-modules", "a=/x", "a=/y"], "names 'a' twice"),
])
def test_bad_lora_modules_exit_with_a_message(tiny, flags, message):
    with pytest.raises(SystemExit, match=message):  # the prompt first: --lora-modules takes a list
        main(["generate", "hello", "--model", str(tiny), *ENGINE_ARGS, *flags])


def test_an_unknown_lora_name_exits_2(tiny, capsys):
    code = main(["generate", "--model", str(tiny), *ENGINE_ARGS, "--enable-lora", "--lora", "nope", "hello"])
    assert code == 2
    assert "unknown LoRA adapter 'nope'" in capsys.readouterr().err


def test_runtime_lora_updating_enables_lora(monkeypatch):
    from tessera.cli import build_parser
    from tessera.engine_args import lora_args

    monkeypatch.setenv("LORA_ADAPTERS", "a=/x")  # TGI's variable: read by `serve` alone
    assert lora_args(build_parser().parse_args(["generate", "hi"]))["enable_lora"] is False

    args = build_parser().parse_args(["serve", "--allow-runtime-lora-updating"])
    assert lora_args(args)["enable_lora"] is True
    assert lora_args(build_parser().parse_args(["serve"]))["enable_lora"] is False
