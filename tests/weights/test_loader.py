"""Weight loading: every parameter filled exactly from the checkpoint, packed shards in the
right rows, and every mismatch an error that names the tensor."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from tessera.models.llama.modeling import LlamaForCausalLM
from tessera.ops.registry import OpTarget
from tessera.weights import WeightLoadError, load_weights
from tessera.weights.loader import checkpoint_target
from tessera.weights.safetensors import iter_hf_weights

TARGET = OpTarget("cpu", torch.float32)


def tiny_config(**overrides) -> LlamaConfig:
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=False)
    base.update(overrides)
    return LlamaConfig(**base)


def hf_state(config: LlamaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = HFLlama(config)
    with torch.no_grad():  # make biases non-zero too, so misplaced rows show
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.copy_(torch.randn_like(p))
    return {k: v.clone() for k, v in model.state_dict().items()}


def build(config: LlamaConfig, target: OpTarget = TARGET) -> LlamaForCausalLM:
    return LlamaForCausalLM(config, target)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_shards_land_in_their_rows(bias):
    config = tiny_config(attention_bias=bias, mlp_bias=bias)
    state = hf_state(config)
    model = build(config)
    loaded = load_weights(model, state.items())
    assert loaded == set(dict(model.named_parameters()))
    head_dim = config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}"
        layer = model.model.layers[i]
        kinds = ["weight", "bias"] if bias else ["weight"]
        for kind in kinds:
            qkv = getattr(layer.self_attn.qkv_proj, kind)
            assert qkv.shape[0] == q + 2 * kv
            assert torch.equal(qkv[:q], state[f"{prefix}.self_attn.q_proj.{kind}"])
            assert torch.equal(qkv[q:q + kv], state[f"{prefix}.self_attn.k_proj.{kind}"])
            assert torch.equal(qkv[q + kv:], state[f"{prefix}.self_attn.v_proj.{kind}"])
            gate_up = getattr(layer.mlp.gate_up_proj, kind)
            assert torch.equal(gate_up[:inter], state[f"{prefix}.mlp.gate_proj.{kind}"])
            assert torch.equal(gate_up[inter:], state[f"{prefix}.mlp.up_proj.{kind}"])
        assert torch.equal(layer.self_attn.o_proj.weight, state[f"{prefix}.self_attn.o_proj.weight"])
        assert torch.equal(layer.post_attention_layernorm.weight,
                           state[f"{prefix}.post_attention_layernorm.weight"])
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, state["lm_head.weight"])
    assert torch.equal(model.model.norm.weight, state["model.norm.weight"])


def test_shards_in_any_order_and_an_already_packed_tensor():
    config = tiny_config()
    state = hf_state(config)
    # A checkpoint that stores layer 0's QKV already packed, and the rest in reverse order.
    head = "model.layers.0.self_attn"
    packed = torch.cat([state.pop(f"{head}.{n}_proj.weight") for n in "qkv"])
    items = [(f"{head}.qkv_proj.weight", packed)] + list(reversed(list(state.items())))
    model = build(config)
    load_weights(model, items)
    assert torch.equal(model.model.layers[0].self_attn.qkv_proj.weight, packed)
    assert torch.equal(model.model.layers[1].self_attn.qkv_proj.weight[:32],
                       state["model.layers.1.self_attn.q_proj.weight"])


def test_loading_converts_to_the_model_dtype():
    config = tiny_config()
    state = hf_state(config)
    model = build(config, OpTarget("cpu", torch.bfloat16))
    load_weights(model, state.items())
    w = model.model.layers[1].mlp.down_proj.weight
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, state["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16))


def test_missing_plain_weight_is_named():
    config = tiny_config()
    state = hf_state(config)
    del state["model.layers.1.input_layernorm.weight"]
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.input_layernorm\.weight") as info:
        load_weights(build(config), state.items())
    assert "not in the checkpoint" in str(info.value)
    assert "1 model parameters" in str(info.value)


def test_missing_shard_of_a_packed_weight_is_named():
    config = tiny_config()
    state = hf_state(config)
    del state["model.layers.0.self_attn.v_proj.weight"]
    del state["model.layers.1.mlp.gate_proj.weight"]
    with pytest.raises(WeightLoadError) as info:
        load_weights(build(config), state.items())
    message = str(info.value)
    assert "model.layers.0.self_attn.qkv_proj.weight (shards ['v'])" in message
    assert "model.layers.1.mlp.gate_up_proj.weight (shards ['0'])" in message
    assert "q_proj" not in message and "'k'" not in message


def test_missing_lm_head_of_an_untied_model_is_an_error():
    config = tiny_config()
    state = hf_state(config)
    del state["lm_head.weight"]
    with pytest.raises(WeightLoadError, match=r"lm_head\.weight"):
        load_weights(build(config), state.items())


def test_tied_embeddings_share_one_parameter_and_ignore_a_stored_lm_head():
    config = tiny_config(tie_word_embeddings=True)
    state = hf_state(config)
    state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])  # ignored
    model = build(config)
    load_weights(model, state.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])


def test_unexpected_tensor_is_named():
    config = tiny_config()
    state = hf_state(config)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # known, ignored
    state["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    state["model.layers.7.self_attn.q_proj.weight"] = torch.zeros(32, 32)  # no layer 7
    with pytest.raises(WeightLoadError) as info:
        load_weights(build(config), state.items())
    message = str(info.value)
    assert "2 checkpoint tensors match no model parameter" in message
    assert "model.layers.0.mlp.extra_proj.weight" in message
    assert "model.layers.7.self_attn.q_proj.weight" in message
    assert "inv_freq" not in message


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.self_attn.k_proj.weight", (12, 32)),   # a packed shard
    ("model.layers.1.mlp.up_proj.weight", (48, 31)),        # a packed shard, wrong width
    ("model.embed_tokens.weight", (95, 32)),                # a plain weight
    ("model.norm.weight", (32, 1)),
])
def test_shape_mismatch_is_an_error_naming_the_tensor_and_shapes(name, shape):
    config = tiny_config()
    state = hf_state(config)
    expected = tuple(state[name].shape)
    state[name] = torch.zeros(shape)
    with pytest.raises(WeightLoadError) as info:
        load_weights(build(config), state.items())
    message = str(info.value)
    assert name in message
    assert str(tuple(shape)) in message and str(expected) in message


def test_whole_packed_tensor_of_the_wrong_shape_is_an_error():
    config = tiny_config()
    state = hf_state(config)
    head = "model.layers.0.self_attn"
    for n in "qkv":
        del state[f"{head}.{n}_proj.weight"]
    state[f"{head}.qkv_proj.weight"] = torch.zeros(32 + 16, 32)  # q + k only
    with pytest.raises(WeightLoadError, match=r"qkv_proj\.weight.*packed weight"):
        load_weights(build(config), state.items())


def test_hf_folder_round_trip(make_tiny_llama):
    folder, hf = make_tiny_llama()
    config = hf.config
    model = build(config)
    load_weights(model, iter_hf_weights(folder))
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    k = hf.model.layers[1].self_attn.k_proj.weight
    q_rows = config.num_attention_heads * (config.hidden_size // config.num_attention_heads)
    assert torch.equal(qkv[q_rows:q_rows + k.shape[0]], k)


def test_folder_without_weights_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="safetensors"):
        list(iter_hf_weights(tmp_path))


def test_prepare_runs_per_module_as_soon_as_its_weights_are_complete(monkeypatch):
    """With prepare=True each layer is put in its builders' layout right after its last
    tensor arrives (packed shards: after all of them), before later tensors load, once."""
    from tessera.ops.embedding import LMHead
    from tessera.ops.linear import Linear

    config = tiny_config()
    state = hf_state(config)
    model = build(config)
    names = {id(m): n for n, m in model.named_modules()}
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(Linear, "prepare_weights", lambda self: events.append(("prepare", names[id(self)])))
    monkeypatch.setattr(LMHead, "prepare_weights", lambda self: events.append(("prepare", names[id(self)])))

    def stream():
        for name, tensor in state.items():
            events.append(("load", name))
            yield name, tensor

    load_weights(model, stream(), prepare=True)
    prepared = [n for kind, n in events if kind == "prepare"]
    assert sorted(prepared) == sorted(names[id(m)] for m in model.modules() if isinstance(m, (Linear, LMHead)))
    for module in prepared:
        at = events.index(("prepare", module))
        loaded_before = {n for kind, n in events[:at] if kind == "load"}
        own = {n for n in state if checkpoint_target(model, n)[0].rsplit(".", 1)[0] == module}
        assert own and own <= loaded_before, (module, own - loaded_before)
        assert events[at - 1][0] == "load" and events[at - 1][1] in own  # right after its last tensor
    events.clear()
    load_weights(build(config), stream())  # prepare=False: the caller prepares later
    assert all(kind == "load" for kind, _ in events)


@pytest.mark.parametrize("bias", [False, True])
def test_prepared_layers_let_go_of_their_loaded_copy_and_refuse_a_second_one(bias):
    """With biases the packed QKV weight is complete before its last bias arrives: it is
    let go with the layer's preparation all the same."""
    import weakref

    config = tiny_config(hidden_size=64, intermediate_size=64, attention_bias=bias)  # in-features: multiples of 32
    state = hf_state(config)
    model = build(config, OpTarget("cpu", torch.bfloat16, quant="int4"))
    layer = model.model.layers[0]
    originals = {"qkv": weakref.ref(layer.self_attn.qkv_proj.weight), "down": weakref.ref(layer.mlp.down_proj.weight)}
    alive_at_the_end = {}

    def stream():
        items = list(state.items())
        assert not items[-1][0].startswith("model.layers.0.")
        for i, item in enumerate(items):
            if i == len(items) - 1:  # layer 0 is long loaded and prepared
                alive_at_the_end.update({k: ref() is not None for k, ref in originals.items()})
            yield item

    load_weights(model, stream(), prepare=True)
    assert layer.mlp.down_proj.weight.dtype == layer.self_attn.qkv_proj.weight.dtype == torch.uint8
    assert alive_at_the_end == {"qkv": False, "down": False}  # freed during loading, not after it
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        again = list(state.items()) + [(name, state[name])]
        with pytest.raises(WeightLoadError, match="loaded already"):
            load_weights(build(config, OpTarget("cpu", torch.bfloat16, quant="int4")), again, prepare=True)
