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
