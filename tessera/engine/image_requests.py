"""A request's images on their way into the engine: a prompt written with the model's image
placeholders and its images become token ids and MultimodalInputs (any thread: it loads
and preprocesses), and add_request checks the two belong together. Refusals are
RequestErrors."""
from __future__ import annotations

from typing import Sequence

from transformers import PreTrainedTokenizerBase

from tessera.engine.request_checks import RequestError
from tessera.models.base import BaseRouter
from tessera.multimodal.images import ImageLoadError, load_image
from tessera.multimodal.inputs import MultimodalInputs
from tessera.multimodal.processor import PromptImageError


def image_placeholder(router: BaseRouter) -> str | None:
    """What a prompt writes where an image goes (the model's own, e.g. <image>)."""
    return router.image_prompts.placeholder if router.supports_images else None


def process_images(router: BaseRouter, tokenizer: PreTrainedTokenizerBase, prompt: str, images: Sequence,
                   add_special_tokens: bool) -> tuple[list[int], MultimodalInputs | None]:
    """Token ids and images' inputs of a prompt and its images (PIL images, arrays, URLs,
    data URLs, paths); a prompt without images (nor placeholders) is plain text."""
    if not images and not (router.supports_images and image_placeholder(router) in prompt):
        return list(tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids), None
    if not router.supports_images:
        raise RequestError(f"this model ({router.config.model_type}) takes no images")
    try:
        loaded = [load_image(image, allow_any_path=True) for image in images]
        return router.image_prompts(prompt, loaded, add_special_tokens)
    except (ImageLoadError, PromptImageError) as exc:
        raise RequestError(str(exc)) from exc


def check_image_request(images: MultimodalInputs | None, prompt_is_text: bool, token_ids: list[int]) -> None:
    """Images come with the token ids process_images made of their prompt, and fit them."""
    if images is None:
        return
    if prompt_is_text:
        raise RequestError("a prompt with images comes as the token ids process_images gave")
    if not images.feature_positions or images.feature_positions[-1] >= len(token_ids):
        raise RequestError("the images' placeholder positions do not fit the prompt")
