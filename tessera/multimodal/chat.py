"""Chat messages with images: OpenAI's content parts as chat templates take them."""
from __future__ import annotations

from typing import Any


class ContentPartError(ValueError):
    pass


def image_source(part: dict) -> Any:
    """The image a content part names, or None when it is not an image part. OpenAI's
    {"type": "image_url", "image_url": {"url": ...}} (or the URL alone), vLLM's
    {"type": "image_pil", "image_pil": <PIL image>}, and transformers' {"type": "image",
    "url" | "image" | "path": ...}."""
    kind = part.get("type")
    if kind == "image_url":
        value = part.get("image_url")
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise ContentPartError('an image_url part is {"type": "image_url", "image_url": {"url": "..."}}')
        return url
    if kind == "image_pil":
        return part.get("image_pil")
    if kind == "image":
        for key in ("url", "image", "path"):
            if part.get(key) is not None:
                return part[key]
        raise ContentPartError('an image part names its image: {"type": "image", "url": "..."}')
    return None


def template_content(content: Any, takes_images: bool) -> tuple[Any, list[Any]]:
    """A message's content as the chat template gets it, and the images it holds, in order.

    Text-only models get the text parts joined by newlines (as vLLM hands them over); a
    model that takes images gets transformers' parts, [{"type": "text", "text"}, {"type":
    "image"}], which multimodal templates turn into the model's image placeholder."""
    if not isinstance(content, list):
        return content, []
    parts: list[dict] = []
    images: list[Any] = []
    for part in content:
        if not isinstance(part, dict):
            raise ContentPartError(f"a content part is an object with a type; got {type(part).__name__}")
        source = image_source(part)
        if source is not None:
            if not takes_images:
                raise ContentPartError("this model takes no images (only text content parts)")
            images.append(source)
            parts.append({"type": "image"})
        elif part.get("type") == "text":
            parts.append({"type": "text", "text": part.get("text", "")})
        else:
            raise ContentPartError(f"unsupported content part type {part.get('type')!r} "
                                   f"(text{', image_url' if takes_images else ''})")
    if not takes_images:
        return "\n".join(p["text"] for p in parts), []
    return parts, images
