"""BaseRouter: everything the engine needs to know about one model type.

A router exposes the config, tokenizer, chat template, stop tokens, model class and
weights. Each hook is a cached property backed by a `get_*` method, so a model folder
overrides only what differs from the Hugging Face defaults.
"""
from __future__ import annotations

import json
import logging
from functools import cached_property
from pathlib import Path
from typing import Callable, ClassVar, Iterable, Iterator

import torch
from torch import nn
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from tessera.config import ModelConfig
from tessera.ops.registry import OpTarget
from tessera.ops.rotary import rope_context_length, rope_parameters
from tessera.ops.weights import prepare_weights
from tessera.sampling.params import SamplingParams, SamplingParamsError
from tessera.weights.dummy import load_dummy_weights
from tessera.weights.gguf import gguf_matrix_format, iter_gguf_weights
from tessera.weights.loader import load_weights, takes_int4_parts
from tessera.weights.prequantized import CheckpointQuantization, QuantizedCheckpointError, checkpoint_quantization
from tessera.weights.safetensors import hf_tensor_names, iter_hf_weights
from tessera.weights.source import ModelSource

logger = logging.getLogger(__name__)


# Tokens llama.cpp ends generation on wherever a GGUF's vocabulary has them (its EOG set):
# a GGUF carries one EOS id, while chat models end turns on these (Gemma's <end_of_turn>,
# Phi-3's <|end|>, Llama 3's <|eot_id|> / <|eom_id|>, ChatML's <|im_end|>, ...), which a
# Hugging Face folder lists in generation_config.json.
GGUF_END_OF_GENERATION = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|im_end|>", "<|end|>",
                          "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>",
                          # Gemma 4: its turn's end, and where it waits for tool results
                          "<turn|>", "<|tool_response>")


# generation_config.json values vLLM takes as request defaults; max_new_tokens also caps what
# a request may ask for (vLLM: the least of the request's, this and the context's room)
GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# any of these makes a folder a tokenizer transformers can load
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "tiktoken.model")


class BaseRouter:
    model_types: ClassVar[tuple[str, ...]] = ()   # config.json model_type values served
    model_cls: ClassVar[type[nn.Module]]
    gguf_permute_qk: ClassVar[bool] = False       # llama.cpp permuted Q/K rows on export
    # llama.cpp layer tensor names beyond the shared ones -> Hugging Face names (weights/gguf.py)
    gguf_names: ClassVar[dict[str, str]] = {}
    gguf_global_names: ClassVar[dict[str, str]] = {}  # llama.cpp names outside the blocks (LFM2's)
    gguf_norm_offset: ClassVar[float] = 0.0      # llama.cpp stored norm weights plus this
    gguf_plain_norms: ClassVar[tuple[str, ...]] = ()  # name endings of norms stored without it
    # What `tessera models` / `tessera inspect` report. A router claims a feature only once it
    # has it and a test for it; `features()` reads each router's own declarations, so a folder
    # that subclasses another's router does not inherit claims nobody has tested for it.
    supports_gguf: ClassVar[bool] = False            # loads .gguf files (tested with one)
    supports_sliding_window: ClassVar[bool] = False  # sliding-window attention in the paged cache
    is_moe: ClassVar[bool] = False                   # mixture-of-experts MLP
    supports_tensor_parallel: ClassVar[bool] = False  # not built yet for any model
    supports_lora: ClassVar[bool] = False            # LoRA adapters (tested against PEFT)
    supports_images: ClassVar[bool] = False          # images in prompts (vision_language.py)

    implementation: ClassVar[str] = "native"       # "native" folder or "transformers" fallback
    # encoders (BERT) embed and cannot generate; their prompts attend to themselves whole
    # and pool by default from the first token (decoders: the last)
    generates: ClassVar[bool] = True
    bidirectional: ClassVar[bool] = False
    default_pooling_type: ClassVar[str] = "LAST"

    FEATURES: ClassVar[tuple[str, ...]] = ("supports_gguf", "supports_sliding_window", "is_moe",
                                           "supports_tensor_parallel", "supports_lora", "supports_images")

    @classmethod
    def features(cls) -> dict[str, bool]:
        """{feature attribute: claimed}, from this class's own body only."""
        return {name: bool(vars(cls).get(name, False)) for name in cls.FEATURES}

    def __init__(self, source: ModelSource, metadata_dir: Path, model_config: ModelConfig):
        self.source = source
        self.metadata_dir = metadata_dir  # holds config.json and tokenizer files
        self.model_config = model_config

    @cached_property
    def config(self) -> PretrainedConfig:
        return self.get_config()

    def get_config(self) -> PretrainedConfig:
        return AutoConfig.from_pretrained(str(self.metadata_dir))

    @cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.get_tokenizer()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        given = self.model_config.tokenizer
        path = Path(given).expanduser() if given else Path(self.metadata_dir)
        if given and not path.exists():
            try:  # a hub name already in the local Hugging Face cache loads; nothing downloads
                return AutoTokenizer.from_pretrained(given, local_files_only=True)
            except (OSError, ValueError) as exc:
                raise ValueError(f"tokenizer {given!r} is not a local folder (nor in the local Hugging Face "
                                 "cache); tessera does not download tokenizers") from exc
        if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"{path} has no tokenizer ({', '.join(TOKENIZER_FILES)}); "
                             "pass --tokenizer FOLDER")
        return AutoTokenizer.from_pretrained(str(path))

    @cached_property
    def chat_template(self) -> str | None:
        """The --chat-template override (a file or a literal template), else the tokenizer's."""
        override = self.model_config.chat_template
        if override:
            if any(c in override for c in "{}\n"):  # Jinja text, as vLLM tells the two apart
                return override
            path = Path(override).expanduser()
            if not path.is_file():
                raise ValueError(f"chat template {override!r} looks like a file path, but there is no such file")
            return path.read_text()
        return getattr(self.tokenizer, "chat_template", None)

    @cached_property
    def eos_token_ids(self) -> frozenset[int]:
        return frozenset(self.get_eos_token_ids())

    def get_eos_token_ids(self) -> set[int]:
        ids: set[int] = set()

        def add(value) -> None:
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))

        add(getattr(self.config, "eos_token_id", None))
        gen_config = self.metadata_dir / "generation_config.json"
        if gen_config.is_file():
            add(json.loads(gen_config.read_text()).get("eos_token_id"))
        add(self.tokenizer.eos_token_id)
        if self.source.is_gguf:  # a GGUF has no generation_config: llama.cpp's end markers
            vocab = self.tokenizer.get_vocab()
            add([vocab[marker] for marker in GGUF_END_OF_GENERATION if marker in vocab])
        return ids

    @cached_property
    def sampling_defaults(self) -> dict[str, float]:
        """The sampling parameters the model's generation_config.json sets (vLLM's
        --generation-config auto): the defaults of requests that leave them out, and
        `max_new_tokens`, the most any OpenAI request generates."""
        path = self.metadata_dir / "generation_config.json"
        if self.model_config.generation_config == "vllm" or not path.is_file():
            return {}
        config = json.loads(path.read_text())
        defaults = {key: config[key] for key in GENERATION_SAMPLING_KEYS if config.get(key) is not None}
        try:
            SamplingParams(**defaults)
        except SamplingParamsError as exc:
            raise ValueError(f"{path}: {exc} (--generation-config vllm ignores the file's sampling values)") from exc
        if defaults:
            logger.info("the model's generation_config.json sets default sampling parameters %s for requests "
                        "that leave them out (max_new_tokens also caps the OpenAI routes' max_tokens; "
                        "--generation-config vllm ignores them)", defaults)
        return defaults

    @cached_property
    def max_model_len(self) -> int:
        trained = int(getattr(self.config, "max_position_embeddings", 0) or 2048)
        scaled = rope_context_length(rope_parameters(self.config))  # yarn / dynamic / linear stretch it
        limit = max(trained, scaled or 0)
        wanted = self.model_config.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {trained}"
                             + (f" stretched by its rope scaling to {limit}" if scaled and scaled > trained else ""))
        return wanted or limit

    @cached_property
    def classifies(self) -> bool:
        """A sequence-classification checkpoint (a classifier, or a cross-encoder reranker)."""
        return any(a.endswith("ForSequenceClassification") for a in getattr(self.config, "architectures", None) or ())

    @property
    def longest_attention_span(self) -> int:
        """The most prompt tokens that attend to each other rather than causally (one image
        of Gemma 3; an encoder's whole prompt): a step may take them whole, past its budget;
        0: causal throughout."""
        return self.max_model_len if self.bidirectional else 0

    def path_note(self) -> str:
        """How this model runs, for `tessera inspect`."""
        return f"native model folder ({type(self).__module__.rsplit('.', 1)[0]})"

    def build_model(self, target: OpTarget) -> nn.Module:
        return self.model_cls(self.config, target)

    def load_weights(self, model: nn.Module,
                     progress: Callable[[Iterable], Iterable] = lambda it: it) -> int:
        """Load the checkpoint into `model` (progress wraps the tensor stream); returns the
        number of parameters loaded. `load_format="dummy"` fills seeded random values."""
        if self.model_config.load_format == "dummy":
            count = load_dummy_weights(model)
        else:
            kept = getattr(model, "packed_checkpoint_methods", ())
            count = len(load_weights(model, progress(self.iter_weights(kept, int4=takes_int4_parts(model))),
                                     prepare=True))
        prepare_weights(model)  # whatever the loading left unprepared (all of a dummy model)
        return count

    def iter_weights(self, kept: tuple[str, ...] = (), int4: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors, pre-quantized ones dequantized, unless the model keeps
        that method's parts as stored (`kept`: a model's `packed_checkpoint_methods`; `int4`:
        its layers take a GGUF's Q4_0 / Q4_1 / Q4_K parts as stored, weights/gguf_q4.py)."""
        if self.source.is_gguf:
            cfg = self.config
            permute = self.gguf_permute_qk  # (the head counts matter only then; Gemma 4's vary by layer)
            weights = iter_gguf_weights(
                self.source.path, permute_qk=permute,
                num_heads=cfg.num_attention_heads if permute else 0,
                num_kv_heads=(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) if permute else 0,
                index_dir=self.metadata_dir, names=self.gguf_names, norm_offset=self.gguf_norm_offset,
                num_layers=getattr(cfg, "num_hidden_layers", None), packed=kept,
                global_names=self.gguf_global_names, plain_norms=self.gguf_plain_norms,
                int4=int4)
            return ((name, self.gguf_tensor(name, tensor)) for name, tensor in weights)
        weights = iter_hf_weights(self.source.path, lazy=True)
        quant = self.checkpoint_quantization
        if quant is None:
            return weights
        if quant.method in kept:
            logger.info("%s checkpoint: its quantized weights stay packed", quant.method)
            return weights
        names = hf_tensor_names(self.source.path)
        if not names:
            raise QuantizedCheckpointError(f"{self.source.path}: pre-quantized ({quant.method}) weights are "
                                           "read from *.safetensors files only")
        logger.info("%s checkpoint: quantized weights are dequantized as they load%s", quant.method,
                    "".join(f"; {note}" for note in quant.notes))
        return quant.dequantized(weights, names)

    def gguf_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A GGUF tensor (by its Hugging Face name) as the checkpoint holds it, where
        llama.cpp's converter stored it otherwise than renaming and permuting (Qwen3.5's)."""
        return tensor

    @cached_property
    def stored_matrix_format(self) -> str | None:
        """How a GGUF stores most of its weight matrices (e.g. "Q4_1"); None for other sources."""
        return gguf_matrix_format(self.source.path, self.metadata_dir) if self.source.is_gguf else None

    @cached_property
    def checkpoint_quantization(self) -> CheckpointQuantization | None:
        """How a pre-quantized checkpoint stores its weights (weights/prequantized.py); None
        for a dense one or a GGUF (whose own quantization weights/gguf.py reads)."""
        return None if self.source.is_gguf else checkpoint_quantization(self.config)


class EncoderRouter(BaseRouter):
    """An encoder's router (BERT and its successors): it pools, never generates; a prompt
    attends to itself whole. A *ForSequenceClassification checkpoint builds `classifier_cls`,
    any other `model_cls` (an embedding model)."""

    generates = False
    bidirectional = True
    classifier_cls: ClassVar[type[nn.Module]]

    def build_model(self, target: OpTarget) -> nn.Module:
        return (self.classifier_cls if self.classifies else self.model_cls)(self.config, target)
