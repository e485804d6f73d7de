"""`tessera bench` runs both engines on the same workload and reports real measurements."""
from __future__ import annotations

import json

import pytest

from tessera.bench.workload import Workload
from tessera.cli import main


@pytest.mark.parametrize("workload,extra", [
    ("throughput", ["--num-prompts", "3"]),
    ("latency", ["--batch-sizes", "1,2"]),
])
def test_bench_with_transformers_baseline(make_tiny_llama, tmp_path, capsys, workload, extra):
    folder, _ = make_tiny_llama()
    out = tmp_path / "result.json"
    code = main(["bench", workload, "--model", str(folder), "--dtype", "float32", "--num-kv-blocks", "64",
                 "--input-len", "8", "--output-len", "5", "--repeats", "1", "--baseline", "transformers",
                 "--output-json", str(out), *extra])
    assert code == 0
    data = json.loads(out.read_text())
    engines = [r["engine"] for r in data["results"]]
    assert engines.count("tessera") == engines.count("transformers") >= 1
    metric = "output_tokens_per_s" if workload == "throughput" else "tpot_ms"
    assert all(r[metric] > 0 for r in data["results"])
    table = capsys.readouterr().out
    assert "speedup vs transformers" in table and "| tessera |" in table


def test_workload_prompts_are_reproducible_and_avoid_special_ids():
    w = Workload(num_prompts=4, input_len=16, output_len=1, seed=3)
    a, b = w.prompts(500, frozenset({250})), w.prompts(500, frozenset({250}))
    assert a == b and len(a) == 4 and all(len(p) == 16 for p in a)
    assert all(100 <= t < 500 and t != 250 for p in a for t in p)


def test_speedup_column_direction():
    from tessera.bench.offline import LatencyResult, ThroughputResult
    from tessera.bench.report import markdown_table

    lat = [LatencyResult("tessera", 1, 10.0, 5.0), LatencyResult("transformers", 1, 10.0, 10.0)]
    table = markdown_table(lat, ["engine", "tpot_ms", "batch_size"], "transformers", higher_is_better=False)
    assert "| tessera | 5.00 | 1 | 2.00x |" in table  # half the time per token: twice as fast
    thr = [ThroughputResult("tessera", 1.0, 1.0, 300.0, 1.0), ThroughputResult("transformers", 1.0, 1.0, 100.0, 1.0)]
    table = markdown_table(thr, ["engine", "output_tokens_per_s"], "transformers")
    assert "| tessera | 300.00 | 3.00x |" in table


@pytest.mark.parametrize("workload,extra,metric", [
    ("prefix", ["--prefix-len", "64", "--input-len", "8"], "ttft_ms"),
    ("chunked", ["--long-prompt-len", "120", "--chunk-tokens", "32", "--num-decodes", "2"], "max_itl_ms"),
])
def test_scenarios_compare_feature_on_and_off(make_tiny_llama, tmp_path, workload, extra, metric):
    folder, _ = make_tiny_llama()
    out = tmp_path / "scenario.json"
    code = main(["bench", workload, "--model", str(folder), "--dtype", "float32", "--num-kv-blocks", "128",
                 "--repeats", "1", "--output-json", str(out), *extra])
    assert code == 0
    results = json.loads(out.read_text())["results"]
    assert [r["engine"].rsplit(" ", 1)[1] for r in results] == ["on", "off"]
    assert all(r[metric] > 0 for r in results)


def _dataset(tmp_path, lines: list[str]):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _tiny_bench(folder, *extra: str) -> int:
    return main(["bench", *extra, "--model", str(folder), "--dtype", "float32", "--num-kv-blocks", "64",
                 "--repeats", "1"])


@pytest.mark.parametrize("baseline", [[], ["--baseline", "transformers"]])
def test_throughput_runs_a_jsonl_dataset(make_tiny_llama, tmp_path, capsys, baseline):
    folder, _ = make_tiny_llama()
    data = _dataset(tmp_path, ['{"prompt": "the quick brown fox"}', "",
                               '{"prompt": "hello", "output_len": 6}',
                               '{"prompt": "a somewhat longer prompt about the weather today"}',
                               '{"prompt": "never read: past --num-prompts"}'])
    out = tmp_path / "result.json"
    assert _tiny_bench(folder, "throughput", "--dataset", str(data), "--num-prompts", "3", "--output-len", "4",
                       "--output-json", str(out), *baseline) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["dataset"] == str(data) and result["meta"]["input_len"] is None
    rows = result["results"]
    assert [r["engine"] for r in rows] == ["tessera"] + (["transformers"] if baseline else [])
    for r in rows:
        assert (r["num_requests"], r["output_tokens"]) == (3, 4 + 6 + 4)  # a line's output_len wins
        assert r["prompt_tokens"] >= 3 and r["output_tokens_per_s"] > 0
    assert rows[0]["prompt_tokens"] == rows[-1]["prompt_tokens"]  # the baseline ran the same prompts
    assert "prompts.jsonl" in capsys.readouterr().out


@pytest.mark.parametrize("lines,message", [
    (['{"prompt": "one"}', '{"prompt": "two"}'], "has 2 prompts, fewer than --num-prompts 3"),
    (['{"prompt": "one"}', '{"text": "two"}', '{"prompt": "three"}'], "line 2: expected"),
    (['{"prompt": "one"}', '{"prompt": "two"', '{"prompt": "three"}'], "line 2: not JSON"),
    (['{"prompt": "one", "output_len": 0}', '{"prompt": "2"}', '{"prompt": "3"}'], "line 1: output_len"),
])
def test_throughput_dataset_errors_name_the_problem(make_tiny_llama, tmp_path, lines, message):
    folder, _ = make_tiny_llama()
    with pytest.raises(SystemExit, match=message):
        _tiny_bench(folder, "throughput", "--dataset", str(_dataset(tmp_path, lines)), "--num-prompts", "3")


def test_dataset_is_for_throughput_embed_and_serve_only(make_tiny_llama, tmp_path):
    folder, _ = make_tiny_llama()
    with pytest.raises(SystemExit, match="--dataset applies to the throughput, embed and serve"):
        _tiny_bench(folder, "latency", "--dataset", str(_dataset(tmp_path, ['{"prompt": "x"}'])))


@pytest.mark.parametrize("baseline", [[], ["--baseline", "transformers"]])
def test_latency_sweep_plot(make_tiny_llama, tmp_path, baseline):
    folder, _ = make_tiny_llama()
    plot = tmp_path / "plots" / "latency.png"
    assert _tiny_bench(folder, "latency", "--batch-sizes", "1,2", "--input-len", "8", "--output-len", "4",
                       "--plot", str(plot), *baseline) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_latency_plot_needs_a_sweep(make_tiny_llama, tmp_path, capsys):
    folder, _ = make_tiny_llama()
    plot = tmp_path / "latency.png"
    assert _tiny_bench(folder, "latency", "--batch-sizes", "2", "--input-len", "8", "--output-len", "4",
                       "--plot", str(plot)) == 0
    assert not plot.exists() and "no plot written" in capsys.readouterr().out


def test_lora_bench_compares_base_one_and_several_adapters(make_tiny_llama, tmp_path, capsys):
    folder, _ = make_tiny_llama()
    out = tmp_path / "lora.json"
    code = main(["bench", "lora", "--model", str(folder), "--dtype", "float32", "--num-kv-blocks", "64",
                 "--batch-sizes", "1,3", "--input-len", "8", "--output-len", "4", "--repeats", "1",
                 "--max-loras", "2", "--max-lora-rank", "4", "--output-json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["engine"], r["batch_size"]) for r in results] == [
        (e, b) for b in (1, 3) for e in ("tessera, base model", "tessera, 1 adapter", "tessera, 2 adapters")]
    assert all(r["output_tokens_per_s"] > 0 for r in results)
    assert "speedup vs tessera, base model" in capsys.readouterr().out


def test_kv_cache_bench_compares_the_fp8_cache_with_the_model_dtype_one(make_tiny_llama, tmp_path, capsys):
    folder, _ = make_tiny_llama()
    out = tmp_path / "kv.json"
    code = main(["bench", "kv-cache", "--model", str(folder), "--dtype", "float32", "--num-kv-blocks", "64",
                 "--kv-cache-dtype", "fp8_e5m2", "--batch-sizes", "1,2", "--input-len", "8",
                 "--output-len", "4", "--repeats", "1", "--output-json", str(out)])
    assert code == 0
    results = json.loads(out.read_text())["results"]
    auto, fp8 = results[:2]
    assert (auto["kv_dtype"], fp8["kv_dtype"]) == ("float32", "float8_e5m2")
    assert auto["kv_bytes_per_token"] == 4 * fp8["kv_bytes_per_token"]
    assert auto["cache_tokens"] == fp8["cache_tokens"] == 64 * 16  # --num-kv-blocks: not sized
    assert auto["cache_capped"] is fp8["cache_capped"] is False
    assert auto["mean_abs_logprob_change"] == 0 < fp8["mean_abs_logprob_change"] < 0.5
    assert abs(auto["nll"] - fp8["nll"]) < 0.5
    assert [(r["engine"], r["batch_size"]) for r in results[2:]] == [
        (e, b) for e in ("tessera, kv auto", "tessera, kv fp8_e5m2") for b in (1, 2)]
    assert all(r["decode_tokens_per_s"] > 0 and r["prefill_tokens_per_s"] > 0 for r in results[2:])
    assert "speedup vs tessera, kv auto" in capsys.readouterr().out


def test_random_bench_adapters_target_every_projection(make_tiny_llama, tmp_path):
    from tessera import LLM
    from tessera.bench.lora import write_random_adapter
    from tessera.lora.adapter import load_adapter

    folder, _ = make_tiny_llama()
    with LLM(folder, dtype="float32", num_kv_blocks=16, show_progress=False, enable_lora=True) as llm:
        path = write_random_adapter(llm.engine, tmp_path / "a", rank=4, seed=0)
        adapter = load_adapter("a", path, llm.engine.model, max_rank=4)
    layers = {f"model.layers.{i}.{m}" for i in range(2)
              for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    assert set(adapter.weights) == layers
    assert set(adapter.weights["model.layers.0.self_attn.qkv_proj"]) == {"q", "k", "v"}
    assert set(adapter.weights["model.layers.0.mlp.gate_up_proj"]) == {0, 1}


@pytest.mark.parametrize("flags, message", [
    (["latency", "--batch-sizes", "1,0"], "--batch-sizes: must be >= 1, got 0"),
    (["latency", "--repeats", "0"], "--repeats: must be >= 1, got 0"),
    (["throughput", "--num-prompts", "-3"], "--num-prompts: must be >= 1, got -3"),
    (["serve", "--request-rate", "-1"], "--request-rate: must be > 0"),
])
def test_sizes_and_counts_are_checked_before_anything_loads(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_images_bench_measures_an_image_beside_text_as_long(tmp_path, capsys, make_tiny_llama):
    """Per image size: the image request's encoder time, TTFT and TPOT, and a text-only
    request of the same prompt length; a text model is told it takes no images."""
    from tests.conftest import TINY_CORPUS
    from tests.multimodal.checkpoints import make_tiny_qwen2_vl

    folder = tmp_path / "qwen"
    make_tiny_qwen2_vl(folder, TINY_CORPUS)
    out = tmp_path / "images.json"
    assert main(["bench", "images", "--model", str(folder), "--dtype", "float32", "--num-kv-blocks", "64",
                 "--image-sizes", "56,112", "--input-len", "8", "--output-len", "4", "--repeats", "1",
                 "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["engine"].split(",")[1].split("(")[0].strip() for r in rows] == [
        "56x56 image", "text only", "112x112 image", "text only"]
    assert [r["image_tokens"] for r in rows] == [4, 0, 16, 0]  # 56 / 14 = 4 patches a side, merged 2 x 2
    assert rows[0]["prompt_tokens"] == rows[1]["prompt_tokens"] and rows[2]["prompt_tokens"] == rows[3]["prompt_tokens"]
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 for r in rows) and rows[0]["encode_ms"] > 0
    assert "| tessera, 56x56 image |" in capsys.readouterr().out
    text, _ = make_tiny_llama()
    with pytest.raises(SystemExit, match="takes no images"):
        main(["bench", "images", "--model", str(text), "--dtype", "float32", "--num-kv-blocks", "64",
              "--repeats", "1"])


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_embed_bench_runs_beside_transformers_and_agrees(make_embedder, tmp_path, capsys, pooling):
    """The baseline's padded, length-sorted batches pool to tessera's vectors (float32)."""
    embedder = make_embedder("qwen3", pooling, True)
    out = tmp_path / "embed.json"
    code = main(["bench", "embed", "--model", str(embedder.folder), "--dtype", "float32", "--num-kv-blocks", "64",
                 "--num-prompts", "5", "--input-len", "12", "--repeats", "1", "--embed-batch-size", "2",
                 "--baseline", "transformers", "--output-json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert [r["engine"] for r in data["results"]] == ["tessera", "transformers"]
    assert data["meta"]["pooling"] == pooling and data["meta"]["prompt_tokens"] == 60
    assert data["results"][1]["min_cosine"] > 1 - 1e-5
    assert all(r["tokens_per_s"] > 0 for r in data["results"])
    assert "speedup vs transformers" in capsys.readouterr().out


def test_embed_bench_on_a_cross_encoder(tmp_path, capsys):
    """A classifier's logits (one prompt per input) beside transformers' ForSequenceClassification."""
    from tests.conftest import TINY_CORPUS
    from tests.pooling.checkpoints import make_cross_encoder

    make_cross_encoder(tmp_path / "ce", "xlm-roberta", TINY_CORPUS)
    out = tmp_path / "ce.json"
    code = main(["bench", "embed", "--model", str(tmp_path / "ce"), "--dtype", "float32", "--num-kv-blocks", "64",
                 "--num-prompts", "4", "--input-len", "12", "--repeats", "1", "--baseline", "transformers",
                 "--output-json", str(out)])
    assert code == 0
    data = json.loads(out.read_text())
    assert data["meta"]["task"] == "classify" and data["results"][1]["max_logit_diff"] < 1e-4
    assert "largest |logit difference|" in capsys.readouterr().out
