"""Kernel graphs: a captured pass replays its kernel calls (float arguments included) on
whatever its input buffers hold now, equal to running the ops again; a pass that computes
or writes with torch ops is not replayable and says which; a kernel's failure status
surfaces from a replay."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.cpu.build import unavailable_reason
from tessera.ops.cpu.embedding import embedding_cpu
from tessera.ops.cpu.graph import ReplayError, capture
from tessera.ops.cpu import linear as cpu_linear
from tessera.ops.cpu.linear import gemm_linear, pack_weight
from tessera.ops.cpu.norm import rms_norm_bf16

UNAVAILABLE = unavailable_reason("gemm_bf16.c")
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))


def block(ids, table, norm_w, packed, eps):
    x = embedding_cpu(ids, table)
    y, _ = rms_norm_bf16(x, norm_w, eps)
    return gemm_linear(y, packed, None)


@torch.inference_mode()
def test_replay_recomputes_from_the_current_inputs():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(40, 64, generator=g).bfloat16()
    norm_w = (1 + torch.randn(64, generator=g)).bfloat16()
    packed = pack_weight(torch.randn(32, 64, generator=g).bfloat16())
    ids = torch.tensor([3, 7, 11])
    eps = 0.5  # large enough that a mangled float argument changes the result
    with capture() as graph:
        out = block(ids, table, norm_w, packed, eps)
    gemm = "tessera_gemm_packed_amx" if cpu_linear.amx_kernel_ready() else "tessera_gemm_packed_bf16"
    assert graph.replayable and [k.symbol for k, _ in graph.calls] == [
        "tessera_embedding", "tessera_rms_norm_bf16", gemm]
    first = out.clone()
    ids.copy_(torch.tensor([5, 0, 39]))
    graph.replay()
    want = block(ids, table, norm_w, packed, eps)
    assert torch.equal(out, want) and not torch.equal(out, first)


@torch.inference_mode()
def test_torch_compute_or_writes_make_a_pass_unreplayable():
    x = torch.randn(4, 8).bfloat16()
    w = torch.ones(8).bfloat16()
    with capture() as graph:
        y, _ = rms_norm_bf16(x, w, 1e-6)
        y.view(2, 16).t()  # views are fine
        torch.empty_like(y)  # and so are allocations
    assert graph.replayable
    with capture() as graph:
        y, _ = rms_norm_bf16(x, w, 1e-6)
        z = y * 2
        z.add_(1)
    assert graph.refused == ["aten.mul.Tensor", "aten.add_.Tensor"]
    with pytest.raises(ReplayError, match="aten.mul.Tensor"):
        graph.replay()


def test_held_bytes_count_what_the_pass_allocated_not_its_views_of_weights():
    """A mixture's layer reads its experts through views of the stacks: held by the graph
    (as every tensor the pass makes), but not memory the graph costs."""
    weights = torch.zeros(1 << 20)  # 4 MiB, made before the capture
    with capture() as graph:
        weights[3]
        torch.empty(256, dtype=torch.uint8)
    assert graph.replayable and graph.held_bytes == 256


@torch.inference_mode()
def test_a_kernel_failure_during_replay_is_an_error_naming_it():
    table = torch.randn(10, 16)
    ids = torch.tensor([1, 2])
    with capture() as graph:
        out = embedding_cpu(ids, table)
    ids[1] = 10  # outside the table: the kernel refuses and writes nothing
    before = out.clone()
    with pytest.raises(ReplayError, match="tessera_embedding"):
        graph.replay()
    assert torch.equal(out, before)


@torch.inference_mode()
def test_only_the_capturing_threads_calls_are_recorded():
    import threading

    table = torch.randn(10, 16)
    ids = torch.tensor([1, 2])
    other = threading.Thread(target=lambda: [(embedding_cpu(ids, table), table * 2) for _ in range(50)])
    with capture() as graph:
        other.start()
        other.join()
        embedding_cpu(ids, table)
    assert len(graph.calls) == 1 and graph.replayable
