"""The decode roofline counts the bytes a step really reads and is reported by
`tessera bench latency` beside each TPOT."""
from __future__ import annotations

import json

import pytest
import torch

from tessera.bench.roofline import Roofline, copy_bandwidth_gbs, decode_weight_bytes
from tessera.cli import main
from tessera.llm import LLM


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_skip_a_lookup_only_embedding(make_tiny_llama, tied):
    folder, hf = make_tiny_llama(tie_word_embeddings=tied)
    with LLM(str(folder), dtype="float32", num_kv_blocks=16, show_progress=False) as llm:
        model = llm.engine.runner.model
        counted, experts, _ = decode_weight_bytes(model)
    assert experts == 0
    # transformers' parameters() lists a tied table once; an untied table is only looked up
    every = sum(p.numel() for p in hf.parameters()) * 4
    table = hf.model.embed_tokens.weight.numel() * 4
    assert counted == (every if tied else every - table)


def test_step_floor_adds_the_kv_of_every_row():
    roof = Roofline(bandwidth_gbs=100.0, weight_bytes=10**9, kv_bytes_per_token=1000)
    assert roof.step_ms(1, 0) == pytest.approx(10.0)
    assert roof.step_ms(4, 500) == pytest.approx((10**9 + 4 * 500 * 1000) / 100e9 * 1e3)


def test_routed_experts_count_only_for_the_tokens_routed_to_them(tmp_path, tiny_tokenizer_dir):
    """Mixtral's tiny stacks (4 experts, top-2): a step of one token reads half of them, a
    batch of B the expected share 1 - (1/2)^B; everything else is read once a step."""
    from tests.models.test_moe_parity import make_tiny_moe

    hf = make_tiny_moe(tmp_path, tiny_tokenizer_dir, "mixtral", num_local_experts=4, intermediate_size=96)
    with LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, show_progress=False) as llm:
        dense, experts, share = decode_weight_bytes(llm.engine.runner.model)
    stacks = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n) * 4
    assert (experts, share) == (stacks, 0.5)
    table = hf.model.embed_tokens.weight.numel() * 4
    assert dense == sum(p.numel() for p in hf.parameters()) * 4 - stacks - table
    roof = Roofline(bandwidth_gbs=1.0, weight_bytes=dense, kv_bytes_per_token=0, expert_bytes=experts,
                    expert_share=share)
    assert roof.step_ms(1, 0) == pytest.approx((dense + experts / 2) / 1e6)
    assert roof.step_ms(3, 0) == pytest.approx((dense + experts * 7 / 8) / 1e6)


def test_windowed_layers_read_at_most_their_window():
    roof = Roofline(bandwidth_gbs=1.0, weight_bytes=0, kv_bytes_per_token=100, windowed_kv=((8, 50),))
    assert roof.step_ms(2, 4) == pytest.approx(2 * (4 * 100 + 4 * 50) / 1e6)
    assert roof.step_ms(2, 1000) == pytest.approx(2 * (1000 * 100 + 8 * 50) / 1e6)


def test_copy_bandwidth_is_a_plausible_figure():
    gbs = copy_bandwidth_gbs(torch.device("cpu"), size_bytes=64 << 20, repeats=3)
    assert 0.1 < gbs < 10_000


def test_latency_bench_reports_the_roofline(make_tiny_llama, tmp_path, capsys):
    folder, _ = make_tiny_llama()
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", str(folder), "--dtype", "float32", "--num-kv-blocks", "64",
                 "--input-len", "8", "--output-len", "5", "--repeats", "1", "--batch-sizes", "1,2",
                 "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    roof = data["meta"]["roofline"]
    assert roof["bandwidth_gbs"] > 0 and roof["weight_bytes"] > 0
    assert roof["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 KV heads of 16, fp32
    for row in data["results"]:
        assert row["roofline_pct"] == pytest.approx(100 * row["roofline_ms"] / row["tpot_ms"])
    assert data["results"][1]["roofline_ms"] > data["results"][0]["roofline_ms"]  # more KV read
    assert "roofline_pct" in capsys.readouterr().out


def test_recurrent_state_is_read_and_written_by_every_row(tmp_path, tiny_tokenizer_dir):
    """A hybrid model's floor counts each sequence's whole state twice a step, whatever its
    context, and the K/V of its attention layers only."""
    from tessera.bench.roofline import engine_roofline
    from tests.models.test_qwen3_next import make_tiny_qwen3_next

    make_tiny_qwen3_next("qwen3_5_text", tmp_path, tiny_tokenizer_dir)
    with LLM(str(tmp_path), dtype="float32", num_kv_blocks=16, max_num_seqs=4, show_progress=False) as llm:
        roof = engine_roofline(llm.engine)
    conv, matrix = (2 * 2 * 16 + 4 * 8) * 3 * 4, 4 * 16 * 8 * 4  # per linear layer (2 of them), fp32
    assert roof.state_bytes_per_seq == 2 * (conv + matrix)
    assert roof.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # the 2 attention layers' K and V
    extra = roof.step_ms(3, 10) - roof.step_ms(3, 0)
    assert roof.step_ms(3, 0) - roof.step_ms(2, 0) == pytest.approx(2 * roof.state_bytes_per_seq / roof.bandwidth_gbs / 1e6)
    assert extra == pytest.approx(3 * 10 * roof.kv_bytes_per_token / roof.bandwidth_gbs / 1e6)
