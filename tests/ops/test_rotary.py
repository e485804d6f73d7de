"""Rope scaling kinds against transformers' own ROPE_INIT_FUNCTIONS (inv_freq and the
cos/sin attention scaling), and the per-sequence length rule of the length-dependent kinds
(dynamic, longrope) against transformers' rotary module run one sequence at a time."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tessera.ops.attention.metadata import AttentionMetadata, attention_context
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import RotaryEmbedding, rope_frequencies, rope_parameters

HEAD = 16
MAX_POS = 256
ORIGINAL = 64
TARGET = OpTarget("cpu", torch.float32)

KINDS = {
    "linear": dict(rope_type="linear", factor=2.0),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=ORIGINAL),
    "yarn-betas-no-truncate": dict(rope_type="yarn", factor=4.0, beta_fast=16, beta_slow=2,
                                   truncate=False, original_max_position_embeddings=ORIGINAL),
    "yarn-mscale": dict(rope_type="yarn", factor=8.0, mscale=0.7, mscale_all_dim=1.0,
                        original_max_position_embeddings=ORIGINAL),
    "yarn-attention-factor": dict(rope_type="yarn", factor=4.0, attention_factor=1.3,
                                  original_max_position_embeddings=ORIGINAL),
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=ORIGINAL),
    "longrope": dict(rope_type="longrope", original_max_position_embeddings=ORIGINAL,
                     short_factor=[1.0 + 0.1 * i for i in range(HEAD // 2)],
                     long_factor=[2.0 + 0.5 * i for i in range(HEAD // 2)]),
    "longrope-attention-factor": dict(rope_type="longrope", original_max_position_embeddings=ORIGINAL,
                                      attention_factor=1.1, short_factor=[1.0] * (HEAD // 2),
                                      long_factor=[3.0] * (HEAD // 2)),
}


def config_for(kind: str):
    rope = {"rope_theta": 10000.0, **KINDS[kind]}
    cls = Phi3Config if rope["rope_type"] == "longrope" else LlamaConfig
    return cls(hidden_size=HEAD * 4, num_attention_heads=4, max_position_embeddings=MAX_POS,
               rope_parameters=rope)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("seq_len", [None, 10, ORIGINAL + 1, MAX_POS, 3 * MAX_POS])
def test_frequencies_match_transformers(kind, seq_len):
    config = config_for(kind)
    want_freq, want_scale = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, None, seq_len=seq_len)
    got_freq, got_scale = rope_frequencies(HEAD, rope_parameters(config), seq_len)
    torch.testing.assert_close(got_freq, want_freq, rtol=1e-6, atol=0)
    assert got_scale == pytest.approx(want_scale, rel=1e-12)


def hf_cos_sin(config, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' rotary module on one sequence's positions (its dynamic update sees
    max(position) + 1 as the sequence length), in a fresh module each call."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    module = Phi3RotaryEmbedding(config)  # same rotary module as Llama's, with longrope support
    pos = torch.tensor([positions])
    cos, sin = module(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0], sin[0]


@pytest.mark.parametrize("kind", ["dynamic", "longrope", "yarn"])
def test_each_sequence_of_a_batch_uses_its_own_length(kind):
    """A mixed step: a decode far past the threshold, a short prefill, a prefill crossing it."""
    config = config_for(kind)
    params = rope_parameters(config)
    rotary = RotaryEmbedding(HEAD, MAX_POS, params, TARGET)
    # dynamic changes past max_position_embeddings (up to 2x here), the others past ORIGINAL
    long_decode = 2 * MAX_POS - 3 if kind == "dynamic" else ORIGINAL + 30
    crossing = MAX_POS + 5 if kind == "dynamic" else ORIGINAL + 8
    seqs = [[long_decode], list(range(12)), list(range(crossing))]
    positions = torch.tensor([p for s in seqs for p in s])
    seq_lens = [s[-1] + 1 for s in seqs]
    query_lens = [len(s) for s in seqs]
    md = AttentionMetadata(slot_mapping=torch.zeros(len(positions), dtype=torch.long),
                           block_tables=torch.zeros(3, 1, dtype=torch.long),
                           seq_lens=torch.tensor(seq_lens), query_start_loc=torch.tensor([0, 1, 13, 13 + crossing]),
                           num_decodes=1, num_decode_tokens=1, seq_lens_list=seq_lens,
                           query_lens_list=query_lens)
    with attention_context(md):  # dynamic: rows past the table (MAX_POS) are computed
        cos, sin = rotary(positions)
    start = 0
    for seq in seqs:
        want_cos, want_sin = hf_cos_sin(config, seq)
        n = len(seq)
        torch.testing.assert_close(cos[start:start + n, 0], want_cos, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sin[start:start + n, 0], want_sin, rtol=1e-5, atol=1e-5)
        start += n


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="rope_type 'su' is not supported"):
        rope_frequencies(HEAD, {"rope_type": "su", "rope_theta": 10000.0})
