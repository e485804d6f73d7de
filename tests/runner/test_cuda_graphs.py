"""CUDA decode graphs: the bucket sizes (everywhere), and on a GPU (skipped without one):
replayed decode steps give the tokens and logprobs of the eager path, every bucket is
captured at start-up, and a batch that shrinks through padded buckets changes nothing."""
from __future__ import annotations

import pytest
import torch

from tessera import LLM, SamplingParams
from tessera.ops import kernel_tuning
from tessera.runner.cuda_graphs import CudaDecodeGraphs, cuda_buckets
from tessera.runner.graph_inputs import GraphLimits, StaticDecodeInputs


def test_buckets_double_to_8_then_step_by_16_then_64_until_max_rows_fit():
    assert cuda_buckets(1) == (1,)
    assert cuda_buckets(6) == (1, 2, 4, 8)
    assert cuda_buckets(8) == (1, 2, 4, 8)
    assert cuda_buckets(20) == (1, 2, 4, 8, 16, 32)
    assert cuda_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    # beyond 256 rows (speculative decoding: max_num_seqs x (1 + k)), steps of 64
    assert cuda_buckets(1280)[19:22] == (256, 320, 384) and cuda_buckets(1280)[-1] == 1280
    assert len(cuda_buckets(1280)) == 36
    assert cuda_buckets(300) == cuda_buckets(256) + (320,)


class _RecordingModel(torch.nn.Module):
    """Records each pass's rows and whether kernel tuning was open for it."""

    def __init__(self):
        super().__init__()
        self.passes: list[tuple[str, int, bool]] = []

    def forward(self, ids, positions):
        self.passes.append(("model", ids.shape[0], kernel_tuning.tuning_open()))
        return torch.zeros(ids.shape[0], 8)

    def compute_logits(self, hidden):
        self.passes.append(("lm_head", hidden.shape[0], kernel_tuning.tuning_open()))
        return torch.zeros(hidden.shape[0], 32)


def test_tuning_passes_run_each_bucket_a_builder_measures_with_the_window_open(monkeypatch):
    """Before capture: one pass per bucket up to the most rows a builder measures at (16,
    the few-row linear's), each followed by the LM head over its rows, all inside one
    tuning window; none for larger buckets (checked on CPU, synchronize stubbed)."""
    model = _RecordingModel()
    graphs = CudaDecodeGraphs(model, block_size=16, device=torch.device("cpu"))
    limits = GraphLimits(max_rows=64, max_model_len=256)
    graphs.inputs = StaticDecodeInputs(cuda_buckets(64), limits, 16, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert kernel_tuning.tuned_row_limit() == 16
    graphs._tune_kernels(limits)
    want = [(kind, rows, True) for rows in (1, 2, 4, 8, 16) for kind in ("model", "lm_head")]
    assert model.passes == want
    assert not kernel_tuning.tuning_open()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replayed_decode_equals_eager_on_the_gpu(make_tiny_llama):
    folder, _ = make_tiny_llama(seed=3)
    prompts = [[5 + i, 6, 7 + 2 * i] * (1 + i % 4) for i in range(11)]
    params = [SamplingParams(max_new_tokens=4 + 2 * i, temperature=0.0, logprobs=2, ignore_eos=True)
              for i in range(11)]
    results = {}
    for eager in (True, False):
        with LLM(folder, dtype="bfloat16", device="cuda", num_kv_blocks=128, block_size=16,
                 max_num_seqs=16, enforce_eager=eager, show_progress=False) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results[eager] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
            if not eager:
                assert llm.engine.runner.graphs.captured_sizes == [1, 2, 4, 8, 16]
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(results[False], results[True]):
        assert tokens == want_tokens
        for got, want in zip(logprobs, want_logprobs):
            assert got.keys() == want.keys()
            for token_id in got:
                assert abs(got[token_id].logprob - want[token_id].logprob) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_few_row_linears_choose_their_kernel_before_capture(make_tiny_llama):
    """Start-up measures each linear shape at every bucket of up to 16 rows (Triton tiles
    against cuBLAS, tessera/ops/kernel_tuning.py) before the graphs are captured, so the
    graphs replay the chosen kernels; every candidate either ran or says why not."""
    from tessera.ops import kernel_tuning
    from tessera.ops.triton import skinny_linear

    folder, _ = make_tiny_llama(seed=3)
    skinny_linear._TABLE.clear()
    measured = len(kernel_tuning.records())
    with LLM(folder, dtype="bfloat16", device="cuda", num_kv_blocks=64, block_size=16, max_num_seqs=4,
             show_progress=False) as llm:
        assert llm.engine.runner.graphs.captured_sizes == [1, 2, 4]
        new = kernel_tuning.records()[measured:]
        assert {r.key[0] for r in new} == {1, 2, 4}
        assert {r.op for r in new} == {"linear"}
        for r in new:
            assert r.timings[r.chosen] is not None and r.timings["torch"] is not None
            assert all((t is None) == (name in r.rejected) for name, t in r.timings.items()), r
            timed = [name for name, t in r.timings.items() if t is not None and name != "torch"]
            assert timed, f"no Triton candidate ran: {r.rejected}"
        out = llm.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
