"""Loading images for vision-language models from untrusted sources, within a ``MediaPolicy``."""
from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import httpx
from PIL import Image

# Formats PIL may open; others (EPS runs Ghostscript, ...) are refused. JPEG includes MPO.
_FORMATS = ('PNG', 'JPEG', 'GIF', 'WEBP', 'BMP')
_FORMS = ('an image must be a PIL image, bytes, a data:image/<format>;base64,... URL, '
          'an http(s):// URL, a file:// URL or a local file path')
_SCHEME = re.compile(r'([A-Za-z][A-Za-z0-9+.-]*):')


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how big they may be."""
    allowed_domains: tuple[str, ...] | None = None  # http(s) hosts allowed; None = any host; () = none; '*' = any
    allowed_local_path: str | None = '/'  # local files allowed only under this directory; None = no local files
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 4096 * 4096
    fetch_timeout: float = 10.0  # seconds, for each network operation and for the whole download


def load_image(source: str | bytes | Image.Image, policy: MediaPolicy = MediaPolicy()) -> Image.Image:
    """Returns a fully decoded RGB image. Raises ValueError with a user-facing message for anything bad."""
    if isinstance(source, Image.Image):
        return _to_rgb(source, policy)
    if isinstance(source, bytes):
        return _decode(source, policy)
    if not isinstance(source, str):
        raise ValueError(f'{_FORMS}, got {type(source).__name__}')
    match = _SCHEME.match(source)
    scheme = match.group(1).lower() if match else ''
    if scheme == 'data':
        return _decode(_data_url_bytes(source), policy)
    if scheme in ('http', 'https'):
        return _decode(_fetch(source, policy), policy)
    if scheme == 'file':
        url = urlsplit(source)
        if url.netloc not in ('', 'localhost'):
            raise ValueError(f'file:// URLs must name a local file, got host {url.netloc!r}')
        return _decode(_read_local(unquote(url.path), policy), policy)
    if scheme or not source:
        raise ValueError(f'{_FORMS}, got {source[:80]!r}')
    return _decode(_read_local(source, policy), policy)


def image_hash(image: Image.Image) -> str:
    """sha256 hex digest of the decoded pixels (mode, size and bytes): the same picture hashes the same."""
    digest = hashlib.sha256(f'{image.mode}:{image.width}x{image.height}:'.encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _data_url_bytes(url: str) -> bytes:
    """The payload of a ``data:image/<format>;base64,...`` URL."""
    header, _, payload = url.partition(',')
    if not header.lower().startswith('data:image/') or not header.lower().endswith(';base64'):
        raise ValueError(f'a data URL must look like data:image/<format>;base64,..., got {header[:80]!r}')
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise ValueError(f'the data URL is not valid base64: {exc}') from exc


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    """Downloads ``url`` from an allowed host, without following redirects, up to ``max_image_bytes``."""
    try:
        parsed = httpx.URL(url)  # the same parse decides the host check and the request
    except httpx.InvalidURL as exc:
        raise ValueError(f'invalid image URL {url[:80]!r}: {exc}') from exc
    host = parsed.host.rstrip('.').lower()
    is_ip = ':' in host or host.replace('.', '').isdigit()  # IP addresses have no subdomains
    allowed = [domain.strip('.').lower() for domain in policy.allowed_domains or ()]
    if policy.allowed_domains is not None and '*' not in allowed and not any(
            domain and (host == domain or not is_ip and host.endswith('.' + domain)) for domain in allowed):
        raise ValueError(f'image domain {host!r} is not allowed (the server allows domains with '
                         '--allowed-media-domains)')
    deadline = time.monotonic() + policy.fetch_timeout
    data = bytearray()
    try:
        with (httpx.Client(timeout=policy.fetch_timeout, follow_redirects=False) as client,
              client.stream('GET', parsed) as response):
            if not response.is_success:
                hint = ' (redirects are not followed)' if response.is_redirect else ''
                raise ValueError(f'fetching image {url[:80]!r} failed: HTTP {response.status_code}{hint}')
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > policy.max_image_bytes:
                    raise ValueError(_too_many_bytes(policy))
                if time.monotonic() > deadline:
                    raise ValueError(f'fetching image {url[:80]!r} timed out after {policy.fetch_timeout} s')
    except httpx.HTTPError as exc:
        raise ValueError(f'could not fetch image {url[:80]!r}: {exc!r}') from exc
    return bytes(data)


def _read_local(path: str, policy: MediaPolicy) -> bytes:
    """Reads a local file inside ``allowed_local_path``, up to one byte past ``max_image_bytes``."""
    if policy.allowed_local_path is None:
        raise ValueError('local image files are not allowed here (the server allows a directory with '
                         '--allowed-local-media-path)')
    root, real = os.path.realpath(policy.allowed_local_path), os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise ValueError(f'image file {path!r} is outside the allowed directory {policy.allowed_local_path!r}')
    if not os.path.isfile(real):
        raise ValueError(f'image file not found: {path!r}; {_FORMS}')
    try:
        with open(real, 'rb') as file:
            return file.read(policy.max_image_bytes + 1)
    except OSError as exc:
        raise ValueError(f'could not read image file {path!r}: {exc.strerror}') from exc


def _too_many_bytes(policy: MediaPolicy) -> str:
    return f'the image is larger than the limit of {policy.max_image_bytes} bytes'


@contextlib.contextmanager
def _decoding() -> Iterator[None]:
    """Turns PIL's many kinds of decoding failure into a ValueError."""
    try:
        yield
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ValueError(f'the image has too many pixels: {exc}') from exc
    except Image.UnidentifiedImageError as exc:
        raise ValueError(f'could not decode the image: not a {", ".join(_FORMATS)} image') from exc
    except Exception as exc:  # plugins raise OSError, SyntaxError, ValueError, EOFError, struct.error, ...
        raise ValueError(f'could not decode the image: {exc}') from exc


def _decode(data: bytes, policy: MediaPolicy) -> Image.Image:
    """Decodes encoded image bytes, reading only the header before the size checks."""
    if len(data) > policy.max_image_bytes:
        raise ValueError(_too_many_bytes(policy))
    with _decoding():
        image = Image.open(io.BytesIO(data), formats=_FORMATS)
    with image:
        return _to_rgb(image, policy)


def _to_rgb(image: Image.Image, policy: MediaPolicy) -> Image.Image:
    """Checks the pixel count, then decodes the pixels and converts them to RGB."""
    width, height = image.size
    if width * height > policy.max_image_pixels:
        raise ValueError(f'the image has {width}x{height} pixels, more than the limit of '
                         f'{policy.max_image_pixels}')
    with _decoding():
        image.load()
        return image.convert('RGB')
