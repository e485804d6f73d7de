"""`tessera models` (the feature table) and `tessera inspect` (router, model class, op
choices with the reasons other builders were rejected) on a tiny llama folder."""
from __future__ import annotations

import json

import pytest
import torch

import tessera.ops  # noqa: F401  (registers the real builders)
from tessera.cli import main
from tessera.models.base import BaseRouter
from tessera.ops import registry
from tessera.ops.registry import register_op, select_op

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=0)
    return folder


@pytest.fixture
def isolated_registry():
    """As tests/ops/test_registry.py: restores builders, recorded selections and the cache."""
    builders = {kind: list(entries) for kind, entries in registry._BUILDERS.items()}
    selections = list(registry._SELECTIONS)
    select_op.cache_clear()
    try:
        yield
    finally:
        registry._BUILDERS.clear()
        registry._BUILDERS.update(builders)
        registry._SELECTIONS[:] = selections
        select_op.cache_clear()


def inspect_json(capsys, *args: str) -> dict:
    assert main(["inspect", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_models_table_lists_native_types_with_their_gguf_support(capsys):
    assert main(["models"]) == 0
    table, _, note = capsys.readouterr().out.partition("\n\n")
    lines = table.splitlines()
    header = lines[0].split("  ")
    assert [h.strip() for h in header if h.strip()] == [
        "MODEL TYPE", "MODEL CLASS", "GENERATES", "GGUF", "SLIDING WINDOW", "MOE", "TENSOR PARALLEL", "LORA",
        "IMAGES"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["llama"][:4] == ["llama", "LlamaForCausalLM", "yes", "yes"]
    assert rows["qwen2"][:4] == ["qwen2", "Qwen2ForCausalLM", "yes", "yes"]
    assert rows["qwen3"][:4] == ["qwen3", "Qwen3ForCausalLM", "yes", "yes"]
    encoders = {t for t, row in rows.items() if row[2] == "no"}
    assert encoders == {"bert", "roberta", "xlm-roberta", "modernbert", "nomic_bert", "gte", "new", "eurobert"}  # embeddings only
    text = {t: row for t, row in rows.items() if row[-1] == "no" and t not in encoders}
    assert all(row[-3:-1] == ["yes", "yes"] for row in text.values())  # every generating text type: TP and LoRA
    assert {t for t, row in rows.items() if row[-1] == "yes"} == {"llava", "llava_next", "idefics3", "smolvlm", "mistral3",
                                                                     "qwen2_vl", "qwen2_5_vl",
                                                                     "qwen3_vl", "qwen3_vl_moe", "gemma3", "qwen3_5",
                                                                     "qwen3_5_moe", "gemma4"}
    assert rows["qwen2_5_vl"][1] == "VisionLanguageForCausalLM" and rows["qwen2_5_vl"][-3:] == ["yes"] * 3
    assert "transformers fallback" in note and "--model-impl" in note


def test_inspect_reports_kv_heads_and_head_sizes_per_layer_type(tmp_path, tiny_tokenizer_dir, capsys):
    """Gemma 4's layer types differ in KV heads and head size (its config refuses to name one
    for all): inspect reads them from the attention layers."""
    from tests.models.test_gemma4 import make

    make(tmp_path, tiny_tokenizer_dir, "moe")
    assert main(["inspect", "--model", str(tmp_path), "--dtype", "float32"]) == 0
    assert "4 heads / 2/1 kv heads, head_dim 32/16" in capsys.readouterr().out


def test_models_json(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["model_type"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["llama"]["router"] == "LlamaRouter" and rows["llama"]["supports_gguf"] is True
    assert rows["qwen3"]["supports_sliding_window"] is False and rows["qwen3"]["is_moe"] is False


def test_features_are_not_inherited_by_subclasses():
    """A folder that reuses another's router claims nothing until it declares it."""
    from tessera.models.llama.router import LlamaRouter

    class Derived(LlamaRouter):
        model_types = ()

    assert LlamaRouter.features()["supports_gguf"] is True
    assert Derived.features() == dict.fromkeys(BaseRouter.FEATURES, False)


def test_inspect_json_names_router_model_class_and_chosen_builders(tiny, capsys):
    info = inspect_json(capsys, "--model", str(tiny), "--dtype", "float32")
    assert info["router"] == "LlamaRouter" and info["model_type"] == "llama"
    assert info["model_class"] == "tessera.models.llama.modeling.LlamaForCausalLM"
    assert info["source"]["kind"] == "hf" and info["path"] == "native"
    c = info["config"]
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_attention_heads"],
            c["num_key_value_heads"], c["head_dim"], c["vocab_size"]) == (2, 64, 4, 2, 16, 512)
    assert c["dtype"] == "float32" and c["dtype_reason"] == "--dtype float32"
    assert info["weights_loaded"] > 0
    chosen = {(op["spec"]["kind"], op["spec"]["phase"]): op["builder"] for op in info["ops"]}
    assert chosen[("linear", None)] == "torch_linear"
    assert chosen[("paged_attention", "decode")] == "torch_paged_decode"
    # 2 layers x (K + V) x 2 kv heads x head_dim 16 x 4 bytes
    assert info["kv_cache"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert info["kv_cache"]["bytes_per_block"] == 16 * info["kv_cache"]["bytes_per_token"]


def test_inspect_says_a_q4_gguf_runs_in_int4_as_stored(default_gguf, capsys):
    """The default model's Q4_1 file: int4 with bf16 where the CPU's int4 kernel runs, and the
    int4 linear builder chosen; none asked for, the model dtype."""
    from tessera.ops.cpu.linear_int4 import kernel_unavailable

    if kernel_unavailable():
        pytest.skip(f"no int4 kernel here: {kernel_unavailable()}")
    info = inspect_json(capsys, "--dtype", "bfloat16")
    assert info["config"]["quantization"] == "int4"
    assert info["config"]["quantization_reason"] == "auto: the GGUF stores its matrices as Q4_1, run in int4"
    assert {op["builder"] for op in info["ops"] if op["spec"]["kind"] == "linear"} >= {"cpu_gemm_int4"}
    info = inspect_json(capsys, "--dtype", "bfloat16", "--quantization", "none")
    assert info["config"]["quantization"] is None


def test_inspect_shows_the_fp8_kv_cache_and_its_builders(tiny, capsys):
    info = inspect_json(capsys, "--model", str(tiny), "--dtype", "bfloat16", "--kv-cache-dtype", "fp8")
    assert info["kv_cache"]["dtype"] == "float8_e4m3fn"
    assert info["kv_cache"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 1  # one byte per element
    attention = [op for op in info["ops"] if op["spec"]["kind"] in ("kv_write", "paged_attention")]
    assert attention and all(op["spec"]["kv_dtype"] == "float8_e4m3fn" for op in attention)
    # the bf16-cache kernels say why they were passed over
    reasons = [r for op in attention for r in op["rejected"] if r["builder"] == "cpu_paged_decode_bf16"]
    assert reasons and "KV cache dtype torch.float8_e4m3fn not supported" in reasons[0]["reasons"]


def test_inspect_lists_rejected_candidates_and_their_reasons(tiny, capsys, isolated_registry):
    @register_op("rms_norm", name="test_f64_only_norm", priority=100, dtypes=(torch.float64,))
    def _norm(*args):  # never chosen: no model asks for float64
        raise AssertionError("not used")

    info = inspect_json(capsys, "--model", str(tiny), "--dtype", "float32", "--no-weights")
    norm = next(op for op in info["ops"] if op["spec"]["kind"] == "rms_norm")
    assert norm["builder"] == "torch_rms_norm"
    assert norm["rejected"][0] == {"builder": "test_f64_only_norm",
                                   "reasons": ["dtype torch.float32 not supported"]}
    # the rest are the fast bf16 CPU builders, passed over for the same reason (and, on a CPU
    # where their kernels cannot run, for that one too), and the CUDA ones for the device
    for r in norm["rejected"]:
        assert ("dtype torch.float32 not supported" in r["reasons"]
                or any(reason.startswith("device cpu") for reason in r["reasons"])), r
    assert any(r["builder"] == "triton_rms_norm" for r in norm["rejected"])
    assert info["weights_loaded"] is None

    assert main(["inspect", "--model", str(tiny), "--dtype", "float32", "--no-weights"]) == 0
    text = capsys.readouterr().out
    assert "rejected test_f64_only_norm: dtype torch.float32 not supported" in text
    assert "router:       LlamaRouter (model_type 'llama')" in text


def test_inspect_records_lookups_even_when_an_earlier_build_made_them(tiny, capsys):
    """selections() lists each lookup once per process; inspect still reports every op."""
    first = inspect_json(capsys, "--model", str(tiny), "--dtype", "float32", "--no-weights")
    again = inspect_json(capsys, "--model", str(tiny), "--dtype", "float32", "--no-weights")
    assert again["ops"] == first["ops"] and len(first["ops"]) >= 7
