"""Images in requests, checked before anything decodes or fetches them.

* **Where an image may come from.** mlx-lm's chat route fetches every ``http(s)`` image URL
  a client sends (``urlopen`` in its HTTP thread): from a server on a network, a way to
  make it reach any address it can (a port scanner). Here only ``data:`` URLs are read
  unless the server is started with ``--allow-image-urls`` (`url_problem`); every route
  says so in a 400 naming the flag.
* **How large.** A PNG of 13,000 × 13,000 pixels is 164 KB on the wire and ~500 MB once
  decoded to RGB (mlx-lm's ``_decode_image``), more in the image processor. The header
  says the size without decoding (PIL's ``Image.open`` reads only that), so an image over
  ``--max-image-pixels`` is refused before any decoding (`pixel_problem`).
* **How much memory decoding takes.** mlx-lm decodes all of a request's images before its
  processor sees any; the memory guard admits that decoding like a request (`decode_bytes`,
  from the headers: ``guards.memory``), on the generation thread, for the message routes
  and ``count_tokens`` alike.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from typing import Any, Callable, Iterator, List, Optional, Tuple
from urllib.request import urlopen

__all__ = ["DEFAULT_MAX_PIXELS", "KEPT_BYTES_PER_PIXEL", "PEAK_BYTES_PER_PIXEL", "image_urls",
           "url_problem", "pixel_problem", "image_problem", "decode_bytes", "decoding",
           "image_probe", "inline", "check_all", "ImagePolicy"]

#: ``--max-image-pixels`` by default: 40 megapixels (a 7,680 × 5,120 photo fits).
DEFAULT_MAX_PIXELS = 40_000_000
#: Seconds and bytes one fetched image may take (with ``--allow-image-urls``).
FETCH_TIMEOUT = 30.0
FETCH_LIMIT = 64 << 20
#: What mlx-lm's ``_decode_image`` keeps of each decoded image until the processor is done
#: with all of them: its RGB ``uint8`` array, 3 bytes a pixel.
KEPT_BYTES_PER_PIXEL = 3
#: What decoding one image takes beside that at its peak: PIL holds the decoded image at 4
#: bytes a pixel (RGB as RGBX), ``convert("RGB")`` a second such copy, and ``np.asarray``
#: reads it through a 3-byte string: 4 + 4 + 3 more. (14 bytes a pixel in all, measured with
#: ``VmHWM`` for RGB and RGBA PNGs of 4,000 x 4,000: 14.0 and 14.0.)
PEAK_BYTES_PER_PIXEL = 11


def _url(part: Any) -> Optional[str]:
    """A content part's image URL (the part kinds mlx-lm's chat route reads), or None."""
    if not isinstance(part, dict) or part.get("type") not in ("image_url", "input_image", "image"):
        return None
    url = part.get("image_url", part.get("image"))
    url = url.get("url") if isinstance(url, dict) else url
    return url if isinstance(url, str) else None


def image_urls(messages: Any) -> Iterator[str]:
    """The image URLs of chat-format ``messages``, in order."""
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                url = _url(part)
                if url is not None:
                    yield url


def url_problem(url: str, allow_urls: bool) -> Optional[str]:
    """Why the server will not read the image ``url``, or None: ``data:`` URLs always,
    ``http(s)`` ones only with ``allow_urls`` (``--allow-image-urls``)."""
    if url.startswith("data:"):
        return None
    if url.startswith(("http://", "https://")):
        if allow_urls:
            return None
        return ("this server does not fetch image URLs (start it with --allow-image-urls to "
                "let it); send the image as a data: URL")
    return f"an image must be a data: URL (or, with --allow-image-urls, http(s)), not {url[:32]!r}"


def _data(url: str) -> bytes:
    head, _, payload = url.partition(",")
    if ";base64" not in head:
        raise ValueError("an image data: URL must be base64 (data:<type>;base64,...)")
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"the image's base64 data cannot be decoded ({e})") from None


def decode_bytes(urls: List[str]) -> int:
    """The memory decoding the ``data:`` URL images ``urls`` takes at its peak, from their
    headers (`decoding`; an unreadable one counts nothing: its request fails first)."""
    return decoding([_inspected(u, True, None)[1] for u in urls])


def decoding(pixels: List[int]) -> int:
    """The memory decoding images of ``pixels`` pixels each takes at its peak: every
    decoded image kept (`KEPT_BYTES_PER_PIXEL`) and the largest one's decoding beside them
    (`PEAK_BYTES_PER_PIXEL`)."""
    return KEPT_BYTES_PER_PIXEL * sum(pixels) + PEAK_BYTES_PER_PIXEL * max(pixels, default=0)


#: The largest side `image_probe` tries, in pixels.
PROBE_SIDE = 4096


def image_probe(processor: Any,
                tokenizer: Any) -> Callable[[int], Optional[Tuple[List[int], Any, int]]]:
    """For the memory guard's measurement at start (``footprint.measure``): given about ``n``
    tokens, one black square image the model's ``processor`` makes into at least that many
    (its side doubled from 32 pixels, up to `PROBE_SIDE`) — ``(prompt ids, pixel values,
    image tokens)`` as mlx-lm's chat route makes them — or None where the processor
    cannot make one."""
    import numpy as np

    placeholder = processor.image_token
    token = tokenizer.convert_tokens_to_ids(placeholder)

    def probe(n: int) -> Optional[Tuple[List[int], Any, int]]:
        side = 32
        while True:
            try:
                text, pixels = processor(placeholder,
                                         images=[np.zeros((side, side, 3), np.uint8)])
            except Exception:  # noqa: BLE001 - a processor that takes no such image
                return None
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            made = ids.count(token)
            if made >= n or side >= PROBE_SIDE:
                return ids, pixels, made
            side *= 2
    return probe


def _read(data: bytes, max_pixels: Optional[int]) -> Tuple[Optional[str], int]:
    """``(problem, pixels)`` of the encoded image ``data``, read from its header only,
    never decoded: why it is refused — unreadable, or more than ``max_pixels`` pixels (0 or
    None: no cap) — or None, and its pixels (0 where unreadable)."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                width, height = im.size
    except Image.DecompressionBombError:  # over twice PIL's own cap (it decodes none)
        ours = (f"this server takes at most {max_pixels:,} (--max-image-pixels)" if max_pixels
                else "more than the image library reads")
        return f"the image is over {2 * (Image.MAX_IMAGE_PIXELS or 0):,} pixels; {ours}", 0
    except Image.UnidentifiedImageError:
        return "the image cannot be read: its data is not an image format the server reads", 0
    except Exception as e:  # noqa: BLE001 - any image PIL cannot read
        return f"the image cannot be read ({type(e).__name__}: {e})", 0
    pixels = int(width) * int(height)
    if max_pixels and pixels > max_pixels:
        return (f"the image is {width} x {height} = {pixels:,} pixels; this server takes "
                f"at most {max_pixels:,} (--max-image-pixels)"), pixels
    return None, pixels


def pixel_problem(data: bytes, max_pixels: Optional[int]) -> Optional[str]:
    """Why the encoded image ``data`` is refused — unreadable, or more than ``max_pixels``
    pixels (0 or None: no cap) — read from its header only, never decoded; or None."""
    return _read(data, max_pixels)[0]


def _inspected(url: str, allow_urls: bool,
               max_pixels: Optional[int]) -> Tuple[Optional[str], int]:
    """``(image_problem, pixels)`` of ``url`` (pixels 0 but for a readable ``data:`` URL)."""
    problem = url_problem(url, allow_urls)
    if problem is not None or not url.startswith("data:"):
        return problem, 0
    try:
        return _read(_data(url), max_pixels)
    except ValueError as e:
        return str(e), 0


def image_problem(url: str, allow_urls: bool, max_pixels: Optional[int]) -> Optional[str]:
    """`url_problem`, then for a ``data:`` URL `pixel_problem` (a fetched URL is checked
    once fetched: `inline`)."""
    return _inspected(url, allow_urls, max_pixels)[0]


def inline(url: str, max_pixels: Optional[int]) -> str:
    """``url`` as a ``data:`` URL (an allowed ``http(s)`` one fetched, at most
    `FETCH_LIMIT` bytes in `FETCH_TIMEOUT` seconds), its size checked; ValueError says
    why it cannot be served."""
    if url.startswith("data:"):
        data = _data(url)
        out = url
    else:
        try:
            with urlopen(url, timeout=FETCH_TIMEOUT) as response:  # noqa: S310 - allowed by flag
                mime = response.headers.get_content_type()
                data = response.read(FETCH_LIMIT + 1)
        except Exception as e:  # noqa: BLE001 - the fetch failed: the request is refused
            raise ValueError(f"the image at {url[:80]} could not be fetched ({e})") from None
        if len(data) > FETCH_LIMIT:
            raise ValueError(f"the image at {url[:80]} is over {FETCH_LIMIT} bytes")
        out = f"data:{mime};base64,{base64.b64encode(data).decode()}"
    problem = pixel_problem(data, max_pixels)
    if problem is not None:
        raise ValueError(problem)
    return out


def check_all(urls: List[str], allow_urls: bool, max_pixels: Optional[int],
              what: str = "an image") -> Optional[str]:
    """The first `image_problem` among ``urls``, said as ``<what> <i>: <problem>``."""
    return _checked(urls, allow_urls, max_pixels, what)[0]


def _checked(urls: List[str], allow_urls: bool, max_pixels: Optional[int],
             what: str = "an image") -> Tuple[Optional[str], int]:
    """``(check_all, decoding)`` of ``urls``, each header read once (the decoding: 0 where
    one is refused)."""
    pixels = []
    for i, url in enumerate(urls):
        problem, n = _inspected(url, allow_urls, max_pixels)
        if problem is not None:
            return (f"{what} {i + 1}: {problem}" if len(urls) > 1 else problem), 0
        pixels.append(n)
    return None, decoding(pixels)


class ImagePolicy:
    """The server's image settings, read from its options: ``allow_urls``
    (``--allow-image-urls``) and ``max_pixels`` (``--max-image-pixels``; 0: no cap)."""

    def __init__(self, allow_urls: bool = False, max_pixels: Optional[int] = DEFAULT_MAX_PIXELS):
        self.allow_urls, self.max_pixels = allow_urls, max_pixels

    @classmethod
    def of(cls, cli_args) -> "ImagePolicy":
        """The policy of the server's options (``--allow-image-urls``,
        ``--max-image-pixels``: `app.add_options` puts both on its parser)."""
        return cls(bool(cli_args.allow_image_urls), int(cli_args.max_image_pixels))

    @staticmethod
    def decode_bytes(messages: Any) -> int:
        """`decode_bytes` of the images of chat-format ``messages``."""
        return decode_bytes(list(image_urls(messages)))

    def problem(self, messages: Any) -> Optional[str]:
        """The first reason an image of chat-format ``messages`` is refused, or None."""
        return self.check(messages)[0]

    def check(self, messages: Any) -> Tuple[Optional[str], int]:
        """``(problem, decode_bytes)`` of the images of chat-format ``messages``, each
        header read once: the first reason one is refused, or None, and what decoding them
        all takes (0 where one is refused)."""
        return _checked(list(image_urls(messages)), self.allow_urls, self.max_pixels)
