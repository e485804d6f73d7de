from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_CORPUS
from tests.multimodal.checkpoints import make_tiny_llava


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> tuple[Path, object]:
    """(folder, transformers' LlavaForConditionalGeneration in float32) of a Llama-based LLaVA."""
    folder = tmp_path_factory.mktemp("tiny-llava")
    return folder, make_tiny_llava(folder, TINY_CORPUS)


@pytest.fixture(scope="session")
def tiny_qwen25_vl(tmp_path_factory) -> tuple[Path, object]:
    """(folder, transformers' Qwen2_5_VLForConditionalGeneration in float32)."""
    from tests.multimodal.checkpoints import make_tiny_qwen2_vl

    folder = tmp_path_factory.mktemp("tiny-qwen2.5-vl")
    return folder, make_tiny_qwen2_vl(folder, TINY_CORPUS)
