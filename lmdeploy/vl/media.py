"""Loading images for vision-language models from untrusted sources, within a ``MediaPolicy``."""
from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import io
import ipaddress
import logging
import os
import re
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import httpcore
import httpx
from PIL import ExifTags, Image, ImageOps

logger = logging.getLogger('lmdeploy')

# Formats PIL may open; others (EPS runs Ghostscript, ...) are refused. JPEG includes MPO.
_FORMATS = ('PNG', 'JPEG', 'GIF', 'WEBP', 'BMP')
_FORMS = ('an image must be a PIL image, bytes, a data:image/<format>;base64,... URL, '
          'an http(s):// URL, a file:// URL or a local file path')
_SCHEME = re.compile(r'([A-Za-z][A-Za-z0-9+.-]*):')


_MAX_REDIRECTS = 5
# the characters of a data URL read for its header: PNG's is in the first bytes, JPEG's after its EXIF and ICC data
_HEADER_CHARS = 2**17


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how big they may be.

    The default refuses every http(s) URL and every local file: only PIL images, bytes and ``data:``
    URLs load. A server opts in with its flags; :meth:`for_local_caller` is what ``pipeline()`` and
    ``lmdeploy chat`` use, whose caller already has the machine's files.
    """
    allowed_domains: tuple[str, ...] | None = ()  # http(s) hosts allowed; () = none; '*' or None = any
    allowed_local_path: str | None = None  # local files allowed only under this directory; None = no local files
    # http(s) hosts that resolve to loopback, private, link-local, shared, multicast, reserved or
    # unspecified addresses are refused, whatever allowed_domains says, unless this is True
    allow_private_hosts: bool = False
    max_image_bytes: int = 20 * 2**20
    max_image_pixels: int = 4096 * 4096
    # longest side over shortest side: a resize to a fixed shortest side (LLaVA's) would make a 1x16000 image
    # 336x5,376,000 pixels; Qwen2-VL's processor has the same bound
    max_image_aspect_ratio: float = 200.0
    fetch_timeout: float = 10.0  # seconds, for each network operation and for the whole download

    @classmethod
    def for_local_caller(cls) -> MediaPolicy:
        """Any local file and any public http(s) host: for a caller on this machine (``pipeline()``,
        ``lmdeploy chat``), never for remote clients."""
        return cls(allowed_domains=('*',), allowed_local_path='/')


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


def image_size(source: object) -> tuple[int, int] | None:
    """An image's (width, height) as its header says, before any decoding, turned upright as its EXIF orientation
    says (as :func:`load_image` turns it): for PIL images, bytes and ``data:`` URLs (only the start of the payload
    decoded where the header lies in it); None for other sources (their size is known only once fetched) and for
    headers that do not open (:func:`load_image` says why)."""
    if isinstance(source, Image.Image):
        try:
            with _decoding():
                return _upright(source.size, source.getexif())
        except ValueError:
            return None
    if isinstance(source, str) and source[:5].lower() == 'data:':
        start = ''.join(source[:_HEADER_CHARS].partition(',')[2].split())
        try:
            size = _header_size(base64.b64decode(start[:len(start) // 4 * 4], validate=True))
            # WebP's reader wants the whole file
            return size if size or len(source) <= _HEADER_CHARS else _header_size(_data_url_bytes(source))
        except (ValueError, binascii.Error):
            return None
    return _header_size(source) if isinstance(source, bytes) else None


def _header_size(data: bytes) -> tuple[int, int] | None:
    try:
        with _decoding(), Image.open(io.BytesIO(data), formats=_FORMATS) as image:
            # the EXIF read so far: PNG's own getexif decodes the pixels to look for an eXIf chunk after them
            return _upright(image.size, Image.Image.getexif(image))
    except ValueError:
        return None


def _upright(size: tuple[int, int], exif: Image.Exif) -> tuple[int, int]:
    """(width, height) once ``ImageOps.exif_transpose`` has turned the image: swapped by a quarter turn."""
    quarter_turn = exif.get(ExifTags.Base.Orientation, 1) in (5, 6, 7, 8)
    return (size[1], size[0]) if quarter_turn else size


def image_hash(image: Image.Image) -> str:
    """sha256 hex digest of the decoded pixels (mode, size and bytes): the same picture hashes the same."""
    digest = hashlib.sha256(f'{image.mode}:{image.width}x{image.height}:'.encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def _data_url_bytes(url: str) -> bytes:
    """The payload of a ``data:image/<format>;base64,...`` URL (line breaks in it, as MIME writes base64, are
    skipped)."""
    header, _, payload = url.partition(',')
    if not header.lower().startswith('data:image/') or not header.lower().endswith(';base64'):
        raise ValueError(f'a data URL must look like data:image/<format>;base64,..., got {header[:80]!r}')
    try:
        return base64.b64decode(''.join(payload.split()), validate=True)
    except binascii.Error as exc:
        raise ValueError(f'the data URL is not valid base64: {exc}') from exc


class _HostRefused(Exception):
    """The host is unknown or resolves to an address the policy refuses (raised at connect time)."""


def _is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether ``ip`` (and any IPv4 address embedded in it) is a global unicast address."""
    candidates = [ip]
    if ip.version == 6:
        candidates += [a for a in (ip.ipv4_mapped, ip.sixtofour, ip.teredo and ip.teredo[1]) if a is not None]
    return all(a.is_global and not (a.is_private or a.is_loopback or a.is_link_local or a.is_multicast
                                    or a.is_reserved or a.is_unspecified) for a in candidates)


def _resolve(host: str, port: int, policy: MediaPolicy) -> list[str]:
    """The addresses of ``host`` to connect to; raises :class:`_HostRefused` if it has none, or if any of
    them is not public and the policy does not allow private hosts."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        raise _HostRefused(f'{host!r} does not resolve') from exc
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise _HostRefused(f'{host!r} has no address')
    if not policy.allow_private_hosts:
        refused = [a for a in addresses if not _is_public(ipaddress.ip_address(a))]
        if refused:
            raise _HostRefused(f'{host!r} resolves to the non-public address {refused[0]}')
    return addresses


class _CheckedBackend(httpcore.SyncBackend):
    """Resolves each host itself, checks the addresses against the policy and connects to exactly those:
    no second lookup, so DNS rebinding between the check and the connection is not possible. TLS still
    verifies the certificate against the host name."""

    def __init__(self, policy: MediaPolicy):
        self.policy = policy

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options=None) -> httpcore.NetworkStream:
        error: Exception | None = None
        for address in _resolve(host, port, self.policy):
            try:
                return super().connect_tcp(address, port, timeout, local_address, socket_options)
            except httpcore.ConnectError as exc:
                error = exc
        raise error


class _CheckedTransport(httpx.HTTPTransport):
    """httpx's transport over :class:`_CheckedBackend`, ignoring proxy settings from the environment (a
    proxy would connect to addresses this process never checked)."""

    def __init__(self, policy: MediaPolicy):
        super().__init__(trust_env=False)
        self._pool = httpcore.ConnectionPool(ssl_context=httpx.create_ssl_context(trust_env=False),
                                             network_backend=_CheckedBackend(policy))


def _check_url(url: httpx.URL, policy: MediaPolicy, original: str | None = None) -> None:
    """Refuses URLs whose scheme is not http(s) or whose host the policy does not list; ``original`` is
    the URL the client sent when ``url`` is where it redirected to."""
    if original is not None and (url.scheme not in ('http', 'https') or not url.host):
        raise ValueError(f'image URL {original[:80]!r} redirects to a URL that is not http(s)')
    host = url.host.rstrip('.').lower()
    is_ip = ':' in host or host.replace('.', '').isdigit()  # IP addresses have no subdomains
    allowed = [domain.strip('.').lower() for domain in policy.allowed_domains or ()]
    if policy.allowed_domains is not None and '*' not in allowed and not any(
            domain and (host == domain or not is_ip and host.endswith('.' + domain)) for domain in allowed):
        if original is not None:
            raise ValueError(f'image URL {original[:80]!r} redirects to a host that is not allowed')
        raise ValueError(f'image domain {host!r} is not allowed (the server allows domains with '
                         '--allowed-media-domains)')


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    """Downloads ``url`` from an allowed, public host, up to ``max_image_bytes``.

    Redirects are followed (at most 5) only to http(s) URLs the policy allows. Error messages name the
    URL but never the upstream status, addresses or connection errors (those go to the log at INFO).
    """
    try:
        parsed = httpx.URL(url)  # the same parse decides the host check and the request
    except httpx.InvalidURL as exc:
        raise ValueError(f'invalid image URL {url[:80]!r}: {exc}') from exc
    _check_url(parsed, policy)
    deadline = time.monotonic() + policy.fetch_timeout
    failed = f'could not fetch image {url[:80]!r}'
    data = bytearray()
    try:
        with httpx.Client(transport=_CheckedTransport(policy), timeout=policy.fetch_timeout,
                          follow_redirects=False, trust_env=False) as client:
            for _ in range(_MAX_REDIRECTS + 1):
                with client.stream('GET', parsed) as response:
                    if response.is_redirect:
                        parsed = parsed.join(response.headers['location'])
                        _check_url(parsed, policy, url)
                        continue
                    if not response.is_success:
                        logger.info('image fetch from %s failed: HTTP %d', parsed.host, response.status_code)
                        raise ValueError(f'{failed}: the host did not answer with an image')
                    for chunk in response.iter_bytes():
                        data += chunk
                        if len(data) > policy.max_image_bytes:
                            raise ValueError(_too_many_bytes(policy))
                        if time.monotonic() > deadline:
                            raise ValueError(f'fetching image {url[:80]!r} timed out after {policy.fetch_timeout} s')
                    return bytes(data)
            raise ValueError(f'{failed}: more than {_MAX_REDIRECTS} redirects')
    except _HostRefused as exc:
        logger.info('image fetch refused: %s', exc)
        raise ValueError(f'{failed}: its host is unknown or not a public address (the server allows private '
                         'addresses with --allow-private-media-hosts)') from None
    except httpx.TimeoutException:
        raise ValueError(f'fetching image {url[:80]!r} timed out after {policy.fetch_timeout} s') from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        logger.info('image fetch from %s failed: %r', parsed.host, exc)
        raise ValueError(f'{failed}: the host did not answer with an image') from None


def _read_local(path: str, policy: MediaPolicy) -> bytes:
    """Reads a regular file inside ``allowed_local_path``, up to one byte past ``max_image_bytes``.

    Every refusal (outside the directory, missing, unreadable, not a regular file) has the same message,
    so that it does not tell whether a path exists.
    """
    if policy.allowed_local_path is None:
        raise ValueError('local image files are not allowed here (the server allows a directory with '
                         '--allowed-local-media-path)')
    refused = ValueError(f'cannot read image file {path!r}: it does not exist, is not a readable file or is '
                         'outside the allowed directory')
    root, real = os.path.realpath(policy.allowed_local_path), os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise refused
    try:  # a symlink swapped in after realpath is not followed; a FIFO does not block the open
        fd = os.open(real, os.O_RDONLY | getattr(os, 'O_NOFOLLOW', 0) | getattr(os, 'O_NONBLOCK', 0))
    except OSError:
        raise refused from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise refused
        with os.fdopen(fd, 'rb', closefd=False) as file:
            return file.read(policy.max_image_bytes + 1)
    except OSError:
        raise refused from None
    finally:
        os.close(fd)


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
    """Checks the pixel count and the aspect ratio, then decodes the pixels, turns them upright as the EXIF
    orientation says (as transformers' ``load_image`` does) and converts them to RGB; transparent pixels go onto
    white, as transformers' image processors put them."""
    width, height = image.size
    if not width or not height:
        raise ValueError(f'the image is {width}x{height} pixels: it has none')
    if width * height > policy.max_image_pixels:
        raise ValueError(f'the image has {width}x{height} pixels, more than the limit of '
                         f'{policy.max_image_pixels}')
    if max(width, height) > policy.max_image_aspect_ratio * min(width, height):
        raise ValueError(f'the image is {width}x{height} pixels: its longest side is more than '
                         f'{policy.max_image_aspect_ratio:g} times its shortest')
    with _decoding():
        image.load()
        if image.getexif().get(ExifTags.Base.Orientation, 1) != 1:
            image = ImageOps.exif_transpose(image)
        if 'A' not in image.getbands() and image.info.get('transparency') is None:
            return image.convert('RGB')
        white = Image.new('RGBA', image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert('RGBA')).convert('RGB')
