"""Images as clients send them: PIL images (Python), base64 data URLs, http(s) URLs, and
local files where the caller allows them (vLLM's --allowed-local-media-path)."""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import ssl
import time
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

from PIL import Image, UnidentifiedImageError

# the most an image download or data URL may hold (a 4k PNG is ~10 MB)
MAX_IMAGE_BYTES = 32 * 1024 * 1024
# the most pixels an image may decode to (a 5000 x 5000 photo; every processor here scales
# larger ones down anyway): a small compressed file can decode to gigabytes
MAX_IMAGE_PIXELS = 25_000_000
FETCH_TIMEOUT_S = 10.0  # for the whole download, not each read


class ImageLoadError(ValueError):
    """An image that cannot be had: bad data, a failed download, a path not allowed."""


def load_image(source: Any, *, allowed_local_path: Path | None = None,
               allow_any_path: bool = False) -> Image.Image:
    """An RGB PIL image from a PIL image, bytes, a data URL, an http(s) URL or a local path.
    Paths (plain or file://) are read only under `allowed_local_path`, or anywhere with
    `allow_any_path` (the Python API, whose caller owns the files)."""
    if isinstance(source, Image.Image):
        return _rgb(source)
    if isinstance(source, (bytes, bytearray)):
        return _decode(bytes(source), "the image bytes")
    if hasattr(source, "__array__") and not isinstance(source, str):
        return _from_array(source)
    if not isinstance(source, str) or not source:
        raise ImageLoadError("an image is a URL, a data URL, a path, a PIL image or an array; got "
                             f"{type(source).__name__}")
    if source[:5].lower() == "data:":
        return _decode(_data_url_bytes(source), "the data URL")
    if is_http_url(source):
        return _decode(_fetch(source), source)
    return _decode(_read_local(local_path(source), allowed_local_path, allow_any_path), source)


def is_http_url(source: object) -> bool:
    return isinstance(source, str) and source[:8].lower().startswith(("http://", "https://"))


def local_path(source: str) -> Path:
    """The file a path or file:// URL names; other URL schemes are refused."""
    scheme, sep, _ = source.partition("://")
    if not sep or "/" in scheme:
        return Path(source).expanduser()
    if scheme.lower() != "file":
        raise ImageLoadError(f"image URLs are http(s)://, data: or file:// URLs; got {scheme}://")
    parsed = urlparse(source)
    if parsed.netloc not in ("", "localhost"):
        raise ImageLoadError(f"a file:// URL names this machine's files; got host {parsed.netloc!r}")
    return Path(url2pathname(parsed.path))


def decode_image(data: bytes, what: str) -> Image.Image:
    """Bytes already fetched (the server downloads them itself) as an RGB image."""
    return _decode(data, what)


def image_hash(image: Image.Image) -> bytes:
    """A digest of the pixels (and their size): what the prefix cache keys image blocks by."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())
    return digest.digest()


def _rgb(image: Image.Image) -> Image.Image:
    """RGB, transparent pixels on white, as transformers' image processors and vLLM do
    (a plain convert("RGB") keeps whatever colour lies under them)."""
    if image.mode == "RGB":
        return image
    rgba = image.convert("RGBA")  # every other mode, as transformers' convert_to_rgb
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255)), rgba).convert("RGB")


def _from_array(array) -> Image.Image:
    """A height x width (x channels) array of uint8, or of floats in [0, 1]; a torch tensor
    may be channels-first."""
    import numpy as np

    if hasattr(array, "detach"):  # torch: [C, H, W] is its images' layout
        array = array.detach().cpu()
        if array.is_floating_point():
            array = array.float()  # numpy has no bfloat16
        if array.dim() == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (1, 3, 4):
            array = array.permute(1, 2, 0)
    values = np.asarray(array)
    if values.ndim == 3 and values.shape[-1] == 1:
        values = values[..., 0]
    if values.ndim not in (2, 3) or (values.ndim == 3 and values.shape[-1] not in (3, 4)):
        raise ImageLoadError(f"an image array is height x width (x 3 or 4 channels); got shape {values.shape}")
    if values.dtype != np.uint8:
        if not np.issubdtype(values.dtype, np.floating) or values.size and not 0.0 <= values.min() <= values.max() <= 1.0:
            raise ImageLoadError(f"an image array holds uint8, or floats in [0, 1]; got {values.dtype}"
                                 + (f" from {values.min():g} to {values.max():g}" if values.size else ""))
        values = (values * 255).round().astype(np.uint8)
    if values.shape[0] * values.shape[1] > MAX_IMAGE_PIXELS:
        raise ImageLoadError(f"the image array has more than the {MAX_IMAGE_PIXELS} pixels an image may have")
    return _rgb(Image.fromarray(values))


def _decode(data: bytes, what: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ImageLoadError(f"{what} is {width} x {height} pixels, more than the {MAX_IMAGE_PIXELS} "
                                 "an image may have")
        image.load()
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ImageLoadError(f"{what} is not an image PIL can read ({exc})") from exc
    return _rgb(image)


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ImageLoadError("an image data URL looks like data:image/png;base64,<data>")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ImageLoadError(f"the image data URL holds more than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageLoadError(f"the image data URL is not valid base64 ({exc})") from exc


async def fetch_image_bytes(url: str) -> bytes:
    """An http(s) image's bytes, within FETCH_TIMEOUT_S in all (headers too: a server that
    sends them a byte at a time is cut off) and MAX_IMAGE_BYTES; for the server, which
    awaits this instead of holding a worker thread."""
    import asyncio

    import httpx

    async def download() -> bytes:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=True, verify=_ssl_context()) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise ImageLoadError(f"fetching {url} answered HTTP {response.status_code}")
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > MAX_IMAGE_BYTES:
                        raise ImageLoadError(f"{url} is larger than {MAX_IMAGE_BYTES} bytes")
                return bytes(data)

    try:
        return await asyncio.wait_for(download(), FETCH_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise ImageLoadError(f"fetching {url} took longer than {FETCH_TIMEOUT_S:.0f} s") from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise ImageLoadError(f"fetching {url} failed: {exc}") from exc


@lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    """One TLS context for every download: building one reads the CA bundle (~20 ms, on the
    server's event loop)."""
    try:
        import certifi

        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:
        return ssl.create_default_context()


def _fetch(url: str) -> bytes:
    import httpx

    deadline = time.monotonic() + FETCH_TIMEOUT_S
    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=True) as response:
            if response.status_code != 200:
                raise ImageLoadError(f"fetching {url} answered HTTP {response.status_code}")
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_IMAGE_BYTES:
                    raise ImageLoadError(f"{url} is larger than {MAX_IMAGE_BYTES} bytes")
                if time.monotonic() > deadline:
                    raise ImageLoadError(f"fetching {url} took longer than {FETCH_TIMEOUT_S:.0f} s")
            return bytes(data)
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise ImageLoadError(f"fetching {url} failed: {exc}") from exc


def _read_local(path: Path, allowed: Path | None, allow_any: bool) -> bytes:
    if not allow_any:
        if allowed is None:
            raise ImageLoadError(f"local image paths are not allowed ({path}); start the server with "
                                 "--allowed-local-media-path DIR to serve images from DIR")
        root = allowed.resolve()
        if not path.resolve().is_relative_to(root):
            raise ImageLoadError(f"{path} is outside the allowed local media path {root}")
    if not path.is_file():
        raise ImageLoadError(f"no image file at {path}")
    if path.stat().st_size > MAX_IMAGE_BYTES:
        raise ImageLoadError(f"{path} is larger than {MAX_IMAGE_BYTES} bytes")
    return path.read_bytes()
