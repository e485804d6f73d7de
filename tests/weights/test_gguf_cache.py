"""The cached conversion of a GGUF's metadata (config, tokenizer, tensor index): converted by
transformers once per file, reused on later loads without parsing the file, and converted
again when the file changes or another file has the same name, size and mtime."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tests.weights.gguf_writer import CONTEXT, write_llama_gguf
from tests.weights.test_gguf import PROMPTS, greedy, load, tiny_llama, unpacked_state

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer_json(tiny_tokenizer_dir) -> Path:
    return Path(tiny_tokenizer_dir) / "tokenizer.json"


@pytest.fixture(scope="module")
def untied(make_tiny_llama) -> torch.nn.Module:
    return tiny_llama(make_tiny_llama, seed=3)


class ConversionSpy:
    """Counts transformers' GGUF conversions (AutoConfig / AutoTokenizer with gguf_file=...)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        import transformers

        self.calls: list[str] = []
        for cls in (transformers.AutoConfig, transformers.AutoTokenizer):
            original = cls.from_pretrained

            def spy(*args, _original=original, _name=cls.__name__, **kwargs):
                if kwargs.get("gguf_file"):
                    self.calls.append(_name)
                return _original(*args, **kwargs)

            monkeypatch.setattr(cls, "from_pretrained", spy)


def cache_folders(cache_dir: Path) -> list[Path]:
    return sorted(p for p in (cache_dir / "gguf").iterdir() if p.is_dir())


def test_metadata_is_converted_once_and_cached(untied, tokenizer_json, tmp_path, monkeypatch):
    spy = ConversionSpy(monkeypatch)
    (tmp_path / "m").mkdir()
    path = write_llama_gguf(tmp_path / "m" / "tiny.gguf", untied, tokenizer_json, QT.Q8_0)
    cache = tmp_path / "cache"
    first = load(path, cache)
    assert sorted(spy.calls) == ["AutoConfig", "AutoTokenizer"]
    [folder] = cache_folders(cache)
    marker = folder / "tessera-conversion.json"
    assert marker.is_file() and (folder / "config.json").is_file()
    stamp = marker.stat().st_mtime_ns

    spy.calls.clear()
    import gguf

    def no_parsing(*args, **kwargs):
        raise AssertionError("the file's metadata was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parsing)  # tensors come from the cached index
    second = load(path, cache)
    assert spy.calls == []  # served from the cache
    assert cache_folders(cache) == [folder]
    assert marker.stat().st_mtime_ns == stamp
    assert second.engine.router.metadata_dir == folder
    weights = [unpacked_state(llm) for llm in (first, second)]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    outs = [llm.generate(PROMPTS, greedy(8), use_tqdm=False) for llm in (first, second)]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]


def test_cache_key_changes_when_the_file_changes(untied, tokenizer_json, tmp_path, monkeypatch):
    spy = ConversionSpy(monkeypatch)
    (tmp_path / "m").mkdir()
    path = write_llama_gguf(tmp_path / "m" / "tiny.gguf", untied, tokenizer_json, QT.F32)
    cache = tmp_path / "cache"
    assert load(path, cache).engine.router.config.max_position_embeddings == CONTEXT
    before = path.stat()

    # Rewritten in place with different metadata (same size); given a later mtime, as any
    # real rewrite would have (set explicitly: a fast rewrite can land in the same tick).
    write_llama_gguf(path, untied, tokenizer_json, QT.F32, context_length=256)
    assert path.stat().st_size == before.st_size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 5_000_000_000))
    spy.calls.clear()
    llm = load(path, cache)
    assert sorted(spy.calls) == ["AutoConfig", "AutoTokenizer"]  # converted again
    assert llm.engine.router.config.max_position_embeddings == 256
    assert len(cache_folders(cache)) == 2

    # A different size (another tensor type) is a new key too.
    write_llama_gguf(path, untied, tokenizer_json, QT.Q8_0)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 5_000_000_000))
    spy.calls.clear()
    load(path, cache)
    assert sorted(spy.calls) == ["AutoConfig", "AutoTokenizer"]
    assert len(cache_folders(cache)) == 3


def test_same_name_size_and_mtime_in_another_folder_is_not_confused(untied, tokenizer_json, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = write_llama_gguf(tmp_path / "a" / "model.gguf", untied, tokenizer_json, QT.F32)
    b = write_llama_gguf(tmp_path / "b" / "model.gguf", untied, tokenizer_json, QT.F32,
                         context_length=256)
    assert a.stat().st_size == b.stat().st_size
    stat = a.stat()
    os.utime(b, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    cache = tmp_path / "cache"
    assert load(a, cache).engine.router.config.max_position_embeddings == CONTEXT
    assert load(b, cache).engine.router.config.max_position_embeddings == 256
