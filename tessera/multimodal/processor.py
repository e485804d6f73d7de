"""A multimodal model's own processor (transformers' AutoProcessor from the model folder):
it expands each image placeholder of a prompt into the model's image tokens and turns the
images into the encoder's inputs."""
from __future__ import annotations

import json
import logging
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch
from PIL import Image

from tessera.multimodal.images import image_hash
from tessera.multimodal.inputs import MultimodalInputs, PromptImage, consecutive_runs

# processor outputs that describe the text, not the images
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


class PromptImageError(ValueError):
    """A prompt and its images that do not fit together."""


class ImagePrompts:
    """Loaded once per model; any thread may call it (one prompt is processed at a time). A
    model folder whose processor needs more (its own placeholder expansion, M-RoPE
    positions) subclasses this."""

    # processor arguments tessera sets itself: not --mm-processor-kwargs'
    reserved_kwargs: tuple[str, ...] = ("return_tensors", "images", "text")

    def __init__(self, folder: Path, image_token_id: int, same_tokens_per_image: bool = False,
                 bidirectional: bool = False, processor_kwargs: dict | None = None):
        """`bidirectional`: each run of consecutive image tokens attends to itself whole
        (MultimodalInputs.attention_spans). `processor_kwargs`: settings passed to every
        call of the image processor (--mm-processor-kwargs); ones it does not take, or
        cannot use, are a ValueError here."""
        self.folder = folder
        self.image_token_id = image_token_id
        self.same_tokens_per_image = same_tokens_per_image
        self.bidirectional = bidirectional
        # requests are processed on worker threads; a fast tokenizer shared between
        # threads can fail with "Already borrowed", so one prompt at a time
        self._lock = threading.Lock()
        with quiet_transformers():
            self.processor = self.load_processor(folder)
        # what a prompt writes where an image goes (chat templates write it themselves)
        self.placeholder: str = getattr(self.processor, "image_token", None) or ""
        if not self.placeholder:
            raise ValueError(f"{folder}: the processor names no image token")
        self.processor_kwargs = dict(processor_kwargs or {})
        if self.processor_kwargs:
            self._check_processor_kwargs()

    def _check_processor_kwargs(self) -> None:
        image_processor = getattr(self.processor, "image_processor", None)
        valid = getattr(getattr(type(image_processor), "valid_kwargs", None), "__annotations__", None)
        name = type(image_processor).__name__
        reserved = sorted(set(self.processor_kwargs) & set(self.reserved_kwargs))
        if reserved:
            raise ValueError(f"--mm-processor-kwargs: {', '.join(reserved)} is set by tessera, not by the flag")
        if valid is not None:
            unknown = sorted(set(self.processor_kwargs) - set(valid))
            if unknown:
                raise ValueError(f"--mm-processor-kwargs: {name} has no setting {', '.join(unknown)} "
                                 f"(it takes {', '.join(sorted(valid))})")
        try:  # values it cannot use fail now, not on every request
            with self._lock:
                self.expand(self.placeholder, [Image.new("RGB", (64, 64), (127, 127, 127))], False)
        except Exception as exc:
            raise ValueError(f"--mm-processor-kwargs {self.processor_kwargs}: {name} cannot use them: {exc}") from exc

    def load_processor(self, folder: Path):
        from transformers import AutoProcessor

        return AutoProcessor.from_pretrained(str(folder))

    @property
    def chat_template(self) -> str | None:
        return getattr(self.processor, "chat_template", None)

    def expand(self, text: str, images: Sequence[Image.Image],
               add_special_tokens: bool) -> tuple[list[int], dict[str, torch.Tensor]]:
        """The prompt's token ids with each placeholder expanded, and the encoder's inputs."""
        out = self.processor(text=[text], images=list(images), return_tensors="pt",
                             add_special_tokens=add_special_tokens, **self.processor_kwargs)
        encoder_inputs = {k: v for k, v in out.items() if k not in TEXT_KEYS and isinstance(v, torch.Tensor)}
        return out["input_ids"][0].tolist(), encoder_inputs

    def largest_image_size(self) -> tuple[int, int]:
        """(width, height) of an image that takes the most tokens (warm-up encodes one to
        measure the vision encoder's memory); processors that resize to a fixed size take
        any."""
        return (1024, 1024)

    def largest_image_inputs(self) -> dict[str, torch.Tensor]:
        """The encoder's inputs for one largest image."""
        image = Image.new("RGB", self.largest_image_size(), (127, 127, 127))
        return self.expand(self.placeholder, [image], add_special_tokens=False)[1]

    def per_image(self, encoder_inputs: dict[str, torch.Tensor], images: Sequence[Image.Image],
                  num_tokens: int) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """Each image's token count and its own encoder inputs. The counts must be right:
        they say which blocks hold which image's tokens, and so what the prefix cache may
        share. With `same_tokens_per_image` (LLaVA 1.5: every image is resized to one size)
        the tokens split evenly and the inputs along their first dimension; otherwise each
        image is processed alone."""
        if len(images) == 1:
            return [(num_tokens, encoder_inputs)]
        if self.same_tokens_per_image:
            if num_tokens % len(images) or any(v.shape[0] != len(images) for v in encoder_inputs.values()):
                raise PromptImageError(f"{num_tokens} image tokens and the processor's outputs do not split "
                                       f"evenly over {len(images)} images")
            return [(num_tokens // len(images), {k: v[i:i + 1] for k, v in encoder_inputs.items()})
                    for i in range(len(images))]
        alone = []
        for image in images:
            ids, inputs = self.expand(self.placeholder, [image], add_special_tokens=False)
            alone.append((ids.count(self.image_token_id), inputs))
        return alone

    def add_positions(self, inputs: MultimodalInputs, ids: list[int],
                      encoder_inputs: dict[str, torch.Tensor]) -> None:
        """Set what a model with positions of its own (M-RoPE) needs, from the prompt's
        processed images (`encoder_inputs`: all of them); nothing by default."""

    def __call__(self, text: str, images: Sequence[Image.Image],
                 add_special_tokens: bool = True) -> tuple[list[int], MultimodalInputs | None]:
        """The prompt's token ids (placeholders expanded) and its images' inputs (None for
        a prompt without images)."""
        found = text.count(self.placeholder)
        if found != len(images):
            raise PromptImageError(
                f"the prompt has {found} image placeholder{'s' * (found != 1)} ({self.placeholder}) "
                f"but {len(images)} image{'s' * (len(images) != 1)} came with it")
        with self._lock:
            if not images:
                return list(self.processor.tokenizer(text, add_special_tokens=add_special_tokens).input_ids), None
            try:
                ids, encoder_inputs = self.expand(text, images, add_special_tokens)
                positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
                each = self.per_image(encoder_inputs, images, len(positions))
            except PromptImageError:
                raise
            except (ValueError, TypeError, IndexError) as exc:  # the processor's own refusals
                raise PromptImageError(f"the model's processor cannot take these images: {exc}") from exc
        if sum(count for count, _ in each) != len(positions):
            raise PromptImageError(f"the processor wrote {len(positions)} image tokens for images of "
                                   f"{sum(count for count, _ in each)} features")
        spans, first = [], 0
        for image, (count, inputs) in zip(images, each):
            mine = positions[first:first + count]
            spans.append(PromptImage(mine[0], mine[-1] + 1, image_hash(image), first, count, inputs))
            first += count
        inputs = MultimodalInputs(spans, positions)
        if self.bidirectional:
            inputs.attention_spans = consecutive_runs(positions)
        self.add_positions(inputs, ids, encoder_inputs)
        return ids, inputs


class OwnExpansionProcessor:
    """A model's image processor and tokenizer, for the models whose transformers processor
    needs torchvision: tessera expands their placeholders itself (qwen2_vl/, mistral3/)."""

    def __init__(self, folder: Path, image_token: str):
        from transformers import AutoImageProcessor, AutoTokenizer

        self.image_processor = AutoImageProcessor.from_pretrained(str(folder))
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.image_token = image_token
        self.chat_template = getattr(self.tokenizer, "chat_template", None) or folder_chat_template(folder)


def expand_placeholders(text: str, placeholder: str, expansions: Sequence[str]) -> str:
    """`text` with its i-th `placeholder` replaced by expansions[i]."""
    pieces = text.split(placeholder)
    return pieces[0] + "".join(expansion + piece for expansion, piece in zip(expansions, pieces[1:]))


def folder_chat_template(folder: Path) -> str | None:
    """A processor's own chat template file in a model folder (chat_template.jinja, or the
    older chat_template.json), for processors tessera assembles itself."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return None


@contextmanager
def quiet_transformers():
    """transformers falls back to its PIL image processors without torchvision, and says so
    on every load; those are the ones tessera runs."""
    log = logging.getLogger("transformers")
    previous = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(previous)
