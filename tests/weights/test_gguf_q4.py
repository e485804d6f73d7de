"""GGUF Q4_0 / Q4_1 matrices under `--quantization int4`: the linear layers take the file's
codes and scales as stored (tessera/weights/gguf_q4.py), so the model runs on exactly the
file's weights. Quantizing the dequantized copy again would not give them back: a Q4_0 block
whose largest code is not 15 gets a narrower step (checked below, so the exact checks cannot
pass by accident)."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tessera import LLM
from tessera.ops.cpu.linear_int4 import unpack_int4
from tessera.ops.linear import Linear, PackedLinear, RowParallelLinear
from tessera.ops.linear_int4 import dequantize_int4, quantize_int4, unpack_int4_rows
from tessera.ops.registry import OpTarget
from tessera.sampling.params import SamplingParams
from tessera.weights.gguf_q4 import Q4Rows
from tests.weights.gguf_writer import round_trip, write_llama_gguf
from tests.weights.test_gguf import HEAD_DIM, HEADS, INTER, KV_HEADS, expected_weights, tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: see conftest


def stored(weights: np.ndarray, qtype: QT) -> Q4Rows:
    """`weights` [n, k] as the file holds them, read back as the loader does."""
    data = gguf.quants.quantize(np.ascontiguousarray(weights, dtype=np.float32), qtype)
    return Q4Rows("w", int(qtype), data, weights.shape, lazy=False)


def values(prepared: torch.Tensor, k: int) -> torch.Tensor:
    """float32 weights of a prepared int4 weight: the reference's rows or the CPU panels."""
    unpack = unpack_int4_rows if prepared.shape[1] == 5 * k // 8 else unpack_int4
    return dequantize_int4(*unpack(prepared, k))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1], ids=["Q4_0", "Q4_1"])
def test_rows_read_as_the_gguf_package_dequantizes(qtype: QT):
    g = np.random.default_rng(0)
    w = (g.standard_normal((24, 96)) * np.exp(g.uniform(-6, 2, (24, 1)))).astype(np.float32)
    rows = stored(w, qtype)
    want = torch.from_numpy(round_trip(w, qtype).copy())
    assert torch.equal(rows.load(), want)
    assert torch.equal(rows.narrow(0, 5, 7), want[5:12])
    assert torch.equal(dequantize_int4(*rows.int4_parts()), want)  # the int4 format holds them exactly
    codes, d, m = rows.int4_parts(rows=(3, 4), cols=(32, 64))
    assert torch.equal(dequantize_int4(codes, d, m), want[3:7, 32:96])
    assert rows.int4_parts(cols=(16, 32)) is None  # (splits a block)


def q4_k_rows(n: int, k: int, seed: int) -> Q4Rows:
    """A Q4_K matrix of random blocks (the gguf package has no Q4_K quantizer): steps and
    offsets of a few orders of magnitude, every scale, min and code drawn."""
    g = np.random.default_rng(seed)
    blocks = g.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    scales = np.exp(g.uniform(-9, -4, (n, k // 256, 2))).astype(np.float16)  # d, dmin
    blocks[..., :4] = scales.view(np.uint8).reshape(n, k // 256, 4)
    return Q4Rows("w", int(QT.Q4_K), blocks.reshape(n, -1), (n, k), lazy=False)


def test_q4_k_rows_read_as_the_gguf_package_dequantizes_and_give_near_exact_parts():
    rows = q4_k_rows(16, 512, seed=3)
    want = torch.from_numpy(gguf.quants.dequantize(rows.data, QT.Q4_K).reshape(16, 512).copy())
    assert torch.equal(rows.load(), want)
    assert torch.equal(rows.narrow(0, 4, 5), want[4:9])
    codes, d, m = rows.int4_parts()  # steps and offsets rounded to float16: 2^-11 relative
    held = dequantize_int4(codes, d, m)
    bound = (15 * d.float().abs() + m.float().abs()) * 2 ** -10
    assert ((held - want).abs().view(16, 16, 32) <= bound.unsqueeze(2)).all()
    again = dequantize_int4(*quantize_int4(want.bfloat16()))  # what loading used to give
    assert (held - want).abs().sum() * 20 < (again - want).abs().sum()
    codes, d, m = rows.int4_parts(rows=(2, 3), cols=(256, 256))
    assert torch.equal(dequantize_int4(codes, d, m), held[2:5, 256:])
    assert rows.int4_parts(cols=(32, 256)) is None  # (splits a 256-weight block)


def test_a_q4_k_layer_prepares_the_stored_parts():
    rows = q4_k_rows(32, 256, seed=4)
    layer = Linear(256, 32, tp_target())
    layer.weight.weight_loader(layer.weight, rows, None)
    layer.prepare_weights()
    assert torch.equal(values(layer.weight, 256), dequantize_int4(*rows.int4_parts()))


def tp_target(rank: int = 0, size: int = 1) -> OpTarget:
    return OpTarget("cpu", torch.bfloat16, tp_size=size, tp_rank=rank, quant="int4")


@pytest.mark.parametrize("rank", [0, 1])
def test_layers_prepare_the_stored_parts(rank: int):
    """Packed shards (each its own tensor, or one stored tensor) and a row-parallel rank's
    columns all come out as the file's values."""
    g = np.random.default_rng(1)
    q, k, v = (g.standard_normal((n, 64)).astype(np.float32) for n in (64, 32, 32))
    down = g.standard_normal((64, 128)).astype(np.float32)
    want = {name: torch.from_numpy(round_trip(w, QT.Q4_0).copy()) for name, w in
            {"q": q, "k": k, "v": v, "down": down}.items()}

    packed = PackedLinear(64, {"q": 64, "k": 32, "v": 32}, tp_target(rank, 2))
    for name, w in (("q", q), ("k", k), ("v", v)):
        packed.weight.weight_loader(packed.weight, stored(w, QT.Q4_0), name)
    whole = PackedLinear(64, {"q": 64, "k": 32, "v": 32}, tp_target(rank, 2))
    whole.weight.weight_loader(whole.weight, stored(np.concatenate([q, k, v]), QT.Q4_0), None)
    rank_rows = torch.cat([want[s][rank * n // 2:(rank + 1) * n // 2] for s, n in (("q", 64), ("k", 32), ("v", 32))])
    for layer in (packed, whole):
        layer.prepare_weights()
        assert torch.equal(values(layer.weight, 64), rank_rows)

    row_parallel = RowParallelLinear(128, 64, tp_target(rank, 2))
    row_parallel.weight.weight_loader(row_parallel.weight, stored(down, QT.Q4_0), None)
    row_parallel.prepare_weights()
    assert torch.equal(values(row_parallel.weight, 64), want["down"][:, rank * 64:(rank + 1) * 64])


def test_a_weight_loaded_otherwise_is_quantized_from_its_values():
    """A float tensor (any other checkpoint) leaves nothing stored to take; so does a layer
    whose rows came partly from a Q4 tensor."""
    w = np.random.default_rng(2).standard_normal((32, 64)).astype(np.float32)
    layer = Linear(64, 32, tp_target())
    layer.weight.weight_loader(layer.weight, torch.from_numpy(w), None)
    layer.prepare_weights()
    want = dequantize_int4(*quantize_int4(torch.from_numpy(w).bfloat16()))
    assert torch.equal(values(layer.weight, 64), want)

    mixed = PackedLinear(64, {"a": 16, "b": 16}, tp_target())
    mixed.weight.weight_loader(mixed.weight, stored(w[:16], QT.Q4_0), "a")
    mixed.weight.weight_loader(mixed.weight, torch.from_numpy(w[16:]), "b")
    mixed.prepare_weights()
    loaded = torch.from_numpy(np.concatenate([round_trip(w[:16], QT.Q4_0), w[16:]]))
    assert torch.equal(values(mixed.weight, 64), dequantize_int4(*quantize_int4(loaded.bfloat16())))


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1], ids=["Q4_0", "Q4_1"])
def test_an_int4_model_runs_on_the_files_weights(qtype, make_tiny_llama, tiny_tokenizer_dir, tmp_path: Path):
    hf = tiny_llama(make_tiny_llama, seed=3)
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", qtype)
    llm = LLM(path, dtype="bfloat16", quantization="int4", num_kv_blocks=16, show_progress=False,
              cache_dir=tmp_path / "cache")
    expected = expected_weights(hf, qtype)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    requantized_differs = False
    for i, layer in enumerate(llm.engine.model.model.layers):
        p = f"model.layers.{i}"
        qkv = values(layer.self_attn.qkv_proj.weight, q)
        gate_up = values(layer.mlp.gate_up_proj.weight, q)
        got = {"self_attn.q_proj": qkv[:q], "self_attn.k_proj": qkv[q:q + kv], "self_attn.v_proj": qkv[q + kv:],
               "self_attn.o_proj": values(layer.self_attn.o_proj.weight, q),
               "mlp.gate_proj": gate_up[:INTER], "mlp.up_proj": gate_up[INTER:],
               "mlp.down_proj": values(layer.mlp.down_proj.weight, INTER)}
        for name, w in got.items():
            want = expected[f"{p}.{name}.weight"]
            assert torch.equal(w, want), name
            again = dequantize_int4(*quantize_int4(want.bfloat16()))
            requantized_differs |= not torch.equal(again, want)
    assert requantized_differs  # (what loading used to give)
    out = llm.generate([[5, 9, 14, 3]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_expert_stacks_take_the_files_parts(tiny_tokenizer_dir, tmp_path: Path):
    """A mixture's stacked Q4_0 experts (llama.cpp's ffn_*_exps) come out as the file's
    values in every expert, gate and up rows as down columns."""
    from tests.weights.gguf_writer import write_model_gguf
    from tests.weights.test_gguf_models import qwen3_moe

    torch.manual_seed(0)
    hf = qwen3_moe()
    path = write_model_gguf(tmp_path / "moe.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", "qwen3moe",
                            qtype=QT.Q4_0)
    llm = LLM(path, dtype="bfloat16", quantization="int4", num_kv_blocks=16, show_progress=False,
              cache_dir=tmp_path / "cache")
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()) for t in reader.tensors}
    requantized_differs = False
    for i, layer in enumerate(llm.engine.model.model.layers):
        experts = layer.mlp.experts
        w13, w2 = experts.w13_weight, experts.w2_weight
        assert w13.dtype == w2.dtype == torch.uint8
        hidden, inter = hf.config.hidden_size, hf.config.moe_intermediate_size
        for e in range(w13.shape[0]):
            gate_up = torch.cat([stored[f"blk.{i}.ffn_gate_exps.weight"][e], stored[f"blk.{i}.ffn_up_exps.weight"][e]])
            down = stored[f"blk.{i}.ffn_down_exps.weight"][e]
            assert torch.equal(values(w13[e], hidden), gate_up), (i, e)
            assert torch.equal(values(w2[e], inter), down), (i, e)
            requantized_differs |= not torch.equal(dequantize_int4(*quantize_int4(gate_up.bfloat16())), gate_up)
    assert requantized_differs


def test_matrices_a_4_bit_file_keeps_wider_take_int8(make_tiny_llama, tiny_tokenizer_dir, tmp_path: Path):
    """As llama.cpp's Q4_K_M keeps attn_v and ffn_down at 6 bits: here layer 0's attn_v and
    ffn_down in Q8_0, the rest Q4_0. Under int4 the layers holding those (the whole packed
    QKV: one format per matrix) take int8, the others the file's int4 parts."""
    from tests.weights.gguf_writer import write_model_gguf

    hf = tiny_llama(make_tiny_llama, seed=5)
    path = write_model_gguf(tmp_path / "mix.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", "llama",
                            qtype=QT.Q4_0, types={"blk.0.attn_v.weight": QT.Q8_0, "blk.0.ffn_down.weight": QT.Q8_0})
    llm = LLM(path, dtype="bfloat16", quantization="int4", num_kv_blocks=16, show_progress=False,
              cache_dir=tmp_path / "cache")
    first, second = llm.engine.model.model.layers
    assert first.self_attn.qkv_proj.weight.dtype == first.mlp.down_proj.weight.dtype == torch.int8
    assert first.self_attn.o_proj.weight.dtype == first.mlp.gate_up_proj.weight.dtype == torch.uint8
    assert all(m.weight.dtype == torch.uint8 for m in (second.self_attn.qkv_proj, second.mlp.down_proj))
    want = expected_weights(hf, QT.Q8_0)["model.layers.0.mlp.down_proj.weight"]
    down = first.mlp.down_proj(torch.eye(INTER, dtype=torch.bfloat16)).float().T  # its weight, read back
    assert torch.allclose(down, want, atol=2e-2 * float(want.abs().max()))
    out = llm.generate([[5, 9, 14, 3]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_expert_stacks_a_4_bit_file_keeps_wider_take_int8(tiny_tokenizer_dir, tmp_path: Path):
    """As llama.cpp's Q4_K_M keeps ffn_down_exps at 6 bits in some layers: here layer 0's in
    Q8_0, the rest Q4_0. Under int4 that down stack takes int8 (the gate-up stack beside it
    the file's int4 parts), with the file's values."""
    from tessera.ops.cpu.linear_int8 import unpack_int8
    from tessera.ops.linear_int8 import dequantize_int8_groups, split_rows
    from tests.weights.gguf_writer import write_model_gguf
    from tests.weights.test_gguf_models import qwen3_moe

    torch.manual_seed(1)
    hf = qwen3_moe()
    path = write_model_gguf(tmp_path / "moe.gguf", hf, Path(tiny_tokenizer_dir) / "tokenizer.json", "qwen3moe",
                            qtype=QT.Q4_0, types={"blk.0.ffn_down_exps.weight": QT.Q8_0})
    llm = LLM(path, dtype="bfloat16", quantization="int4", num_kv_blocks=16, show_progress=False,
              cache_dir=tmp_path / "cache")
    first, second = (layer.mlp.experts for layer in llm.engine.model.model.layers)
    assert first.w2_weight.dtype == torch.int8 and first.w13_weight.dtype == torch.uint8
    assert second.w2_weight.dtype == second.w13_weight.dtype == torch.uint8
    reader = gguf.GGUFReader(str(path))
    down = next(t for t in reader.tensors if t.name == "blk.0.ffn_down_exps.weight")
    want = torch.from_numpy(gguf.quants.dequantize(down.data, down.tensor_type).copy())
    inter = hf.config.moe_intermediate_size
    for e in range(first.w2_weight.shape[0]):
        w = first.w2_weight[e]
        if w.shape[1] == inter + 4:  # the reference's rows (per-row scales)
            q, scale = split_rows(w)
            got = q.float() * scale.unsqueeze(1)
        else:
            got = dequantize_int8_groups(*unpack_int8(w, inter))
        assert torch.allclose(got, want[e], atol=float(want[e].abs().max()) / 100), e
    out = llm.generate([[5, 9, 14, 3]], SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_stored_parts_come_to_the_weights_device():
    """The file's parts are read on the host; a weight elsewhere (CUDA) gets them there."""
    from tessera.ops.linear_int4 import int4_parts

    rows = stored(np.random.default_rng(6).standard_normal((16, 64)).astype(np.float32), QT.Q4_1)
    weight = torch.empty((16, 64), device="meta")
    assert all(part.device.type == "meta" for part in int4_parts(weight, rows.int4_parts()))
