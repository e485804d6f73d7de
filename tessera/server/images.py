"""Images in requests: loaded (downloads, data URLs, allowed local files) and preprocessed
off the event loop, then handed to the engine with the prompt's token ids."""
from __future__ import annotations

import asyncio
from typing import Any, Sequence

from tessera.engine.request_checks import RequestError
from tessera.multimodal.images import (FETCH_TIMEOUT_S, ImageLoadError, decode_image, fetch_image_bytes,
                                      is_http_url, load_image)
from tessera.multimodal.inputs import MultimodalInputs
from tessera.server.errors import ValidationFailed
from tessera.server.state import ServerState


async def prompt_with_images(state: ServerState, text: str, sources: Sequence[Any], *,
                             add_special_tokens: bool, param: str) -> tuple[list[int], MultimodalInputs | None]:
    """The prompt's token ids (image placeholders expanded) and its images' inputs; a bad
    image or a prompt that does not fit its images is a validation error on `param`."""
    limit = state.limits.max_images_per_prompt
    if len(sources) > limit:
        raise ValidationFailed(f"a prompt may show at most {limit} images; this one has {len(sources)} "
                               "(tessera serve --limit-mm-per-prompt '{\"image\": N}')", param=param)
    core = state.engine.engine

    def process(fetched: list) -> tuple[list[int], MultimodalInputs | None]:
        images = [decode_image(source, f"the image at {url}") if url else
                  load_image(source, allowed_local_path=state.allowed_local_media_path)
                  for source, url in fetched]
        return core.process_images(text, images, add_special_tokens)

    try:
        # downloads on the event loop, together, within one deadline (a slow server holds no
        # worker thread), then the decoding and preprocessing in one
        urls = [s for s in sources if is_http_url(s)]
        downloads = await asyncio.wait_for(asyncio.gather(*map(fetch_image_bytes, urls)), FETCH_TIMEOUT_S) if urls else []
        data = dict(zip(urls, downloads))
        fetched = [(data[s], s) if is_http_url(s) else (s, None) for s in sources]
        return await asyncio.to_thread(process, fetched)
    except asyncio.TimeoutError:
        raise ValidationFailed(f"fetching the images took longer than {FETCH_TIMEOUT_S:.0f} s", param=param) from None
    except (ImageLoadError, RequestError) as exc:
        raise ValidationFailed(str(exc), param=param) from exc
