"""The opt-in for programmatic dependent launch (tessera/ops/triton/launch.py): what the
flag accepts, and that nothing but a Hopper-or-later CUDA device launches with it."""
from __future__ import annotations

import pytest
import torch

from tessera.ops.triton import launch


def test_the_flag_is_0_or_1(monkeypatch):
    monkeypatch.delenv(launch.FLAG, raising=False)
    assert not launch.requested()
    monkeypatch.setenv(launch.FLAG, "1")
    assert launch.requested()
    monkeypatch.setenv(launch.FLAG, "0")
    assert not launch.requested()
    monkeypatch.setenv(launch.FLAG, "yes")
    with pytest.raises(ValueError, match="TESSERA_PDL must be 0 or 1, got 'yes'"):
        launch.requested()


def test_cpu_tensors_never_launch_with_pdl(monkeypatch):
    monkeypatch.setenv(launch.FLAG, "1")
    launch._enabled.cache_clear()
    try:
        assert launch.launch_options(torch.zeros(1)) == {"PDL": False}
        assert launch.launch_options(torch.zeros(1), forced=True) == {"PDL": True, "launch_pdl": True}
    finally:
        launch._enabled.cache_clear()
