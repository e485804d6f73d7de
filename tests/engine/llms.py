"""The engine tests' LLM factory: tiny float32 engines, each checked idle at the end."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable, Iterator

from tessera import LLM


@contextlib.contextmanager
def idle_checked_llms(folder: Path, num_kv_blocks: int) -> Iterator[Callable[..., LLM]]:
    """make(folder=None, **engine_args) -> LLM on `folder` (float32, 4-token blocks,
    `num_kv_blocks` unless given); on leaving, every engine made must have no request left
    and every KV block back."""
    built: list[LLM] = []

    def make(other: Path | None = None, **kwargs) -> LLM:
        kwargs.setdefault("num_kv_blocks", num_kv_blocks)
        kwargs.setdefault("block_size", 4)
        llm = LLM(other or folder, dtype="float32", show_progress=False, **kwargs)
        built.append(llm)
        return llm

    yield make
    for llm in built:  # every run must give every block back
        assert not llm.engine.has_unfinished()
        assert llm.engine.block_manager.all_free()
        assert llm.engine.requests == {}
