"""``lmdeploy.vl.media``: loading images from PIL, bytes, data URLs, files and http, within a ``MediaPolicy``."""
from __future__ import annotations

import base64
import io
import os
import random
import threading
import time
import warnings
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from lmdeploy.vl.media import MediaPolicy, image_hash, load_image

BIG_BODY = 64 * 2**20  # what /big would send if the client read it all


def picture(width: int = 5, height: int = 4, seed: int = 0) -> Image.Image:
    """A small RGB image with distinct, seeded pixels."""
    rng = random.Random(seed)
    return Image.frombytes('RGB', (width, height), bytes(rng.randrange(256) for _ in range(width * height * 3)))


def encode(image: Image.Image, fmt: str = 'PNG') -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, mime: str = 'image/png') -> str:
    return f'data:{mime};base64,{base64.b64encode(data).decode()}'


def png_claiming_size(width: int, height: int) -> bytes:
    """An 8x8 PNG whose header (with a valid CRC) claims ``width`` x ``height``: its pixel data is far too short."""
    data = bytearray(encode(picture(8, 8)))
    data[16:24] = width.to_bytes(4, 'big') + height.to_bytes(4, 'big')
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, 'big')
    return bytes(data)


def test_data_url_round_trip():
    original = picture()
    image = load_image(data_url(encode(original)))
    assert (image.mode, image.size) == ('RGB', (5, 4))
    assert image.tobytes() == original.tobytes()


def test_pil_input_is_converted_to_rgb_without_touching_the_original():
    original = picture().convert('RGBA')
    image = load_image(original)
    assert image.mode == 'RGB' and original.mode == 'RGBA'
    assert image.tobytes() == original.convert('RGB').tobytes()


@pytest.mark.parametrize('mode', ['RGBA', 'LA', 'P'])
def test_transparent_pixels_go_onto_white(mode):
    """As transformers' image processors put them (``convert_to_rgb``): an opaque pixel keeps its colour, a
    transparent one turns white, a half-transparent one lies between."""
    if mode == 'P':  # a palette whose second colour is transparent
        image = Image.new('P', (3, 1))
        image.putpalette([40, 80, 120, 200, 10, 10])
        image.putpixel((1, 0), 1)
        image.info['transparency'] = 1
    else:
        image = Image.new('RGB', (3, 1), (40, 80, 120)).convert(mode)
        image.putalpha(Image.frombytes('L', (3, 1), bytes([255, 0, 128])))
    decoded = Image.open(io.BytesIO(encode(image)))
    loaded = load_image(decoded)
    assert loaded.getpixel((1, 0)) == (255, 255, 255)
    assert loaded.getpixel((0, 0)) == image.convert('RGB').getpixel((0, 0))
    assert loaded.tobytes() == convert_to_rgb(decoded, return_numpy=True).tobytes()


def test_bytes_input_png_and_jpeg():
    original = picture(16, 16)
    assert load_image(encode(original)).tobytes() == original.tobytes()
    gray = Image.new('L', (16, 16), 128)
    image = load_image(encode(gray, 'JPEG'))
    assert (image.mode, image.size) == ('RGB', (16, 16))
    assert all(abs(value - 128) <= 2 for value in image.tobytes())


def test_same_picture_same_hash_from_every_source(tmp_path):
    original = picture(seed=1)
    png = encode(original)
    path = tmp_path / 'a.png'
    path.write_bytes(png)
    local = MediaPolicy(allowed_local_path=str(tmp_path))
    hashes = {image_hash(load_image(source, local)) for source in
              (original, png, encode(original, 'BMP'), data_url(png), str(path), path.as_uri())}
    assert len(hashes) == 1
    assert image_hash(load_image(picture(seed=2))) not in hashes
    # the same bytes, but another size or mode, is another picture
    assert image_hash(Image.frombytes('RGB', (4, 5), original.tobytes())) != image_hash(original)
    assert image_hash(Image.frombytes('L', (15, 4), original.tobytes())) != image_hash(original)


def test_base64_broken_into_lines_as_mime_writes_it():
    """``base64.encodebytes`` (MIME) breaks its output every 76 characters; that was refused as not base64."""
    data = encode(picture(64, 48))
    url = 'data:image/png;base64,' + base64.encodebytes(data).decode()
    assert '\n' in url
    assert load_image(url).tobytes() == load_image(data_url(data)).tobytes() == picture(64, 48).tobytes()


def test_bad_base64():
    with pytest.raises(ValueError, match='base64'):
        load_image('data:image/png;base64,iVBOR@@@not-base64')


def test_data_url_that_is_not_an_image():
    with pytest.raises(ValueError, match='data:image/<format>;base64'):
        load_image(data_url(encode(picture()), mime='text/plain'))
    with pytest.raises(ValueError, match='could not decode the image'):
        load_image(data_url(b'just some text'))


def test_non_image_bytes():
    with pytest.raises(ValueError, match='could not decode the image'):
        load_image(b'\x00\x01 definitely not an image' * 10)


def test_truncated_png():
    data = encode(picture(64, 64))
    with pytest.raises(ValueError, match='could not decode the image'):
        load_image(data[:len(data) // 2])


def test_only_common_formats_are_opened():
    eps = b'%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n%%EOF\n'  # PIL would run Ghostscript
    with pytest.raises(ValueError, match='not a PNG, JPEG'):
        load_image(eps)


def test_too_many_pixels_in_encoded_bytes():
    policy = MediaPolicy(max_image_pixels=1000)
    assert load_image(encode(picture(10, 100)), policy).size == (10, 100)
    with pytest.raises(ValueError, match='11x100 pixels, more than the limit of 1000'):
        load_image(encode(picture(11, 100)), policy)
    # refused from the header alone: decoding the too-short pixel data would fail differently
    with pytest.raises(ValueError, match='4000x4000 pixels'):
        load_image(png_claiming_size(4000, 4000), policy)


@pytest.mark.filterwarnings('ignore::PIL.Image.DecompressionBombWarning')
def test_decompression_bombs_refused_and_pil_settings_untouched():
    limit = Image.MAX_IMAGE_PIXELS
    with pytest.raises(ValueError, match='too many pixels'):  # PIL itself refuses this one in Image.open
        load_image(png_claiming_size(20000, 20000), MediaPolicy(max_image_pixels=10**9))
    with pytest.raises(ValueError, match='10000x10000 pixels'):  # PIL only warns about this one
        load_image(png_claiming_size(10000, 10000))
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        with pytest.raises(ValueError, match='too many pixels'):  # ... unless warnings are errors
            load_image(png_claiming_size(10000, 10000))
    assert Image.MAX_IMAGE_PIXELS == limit


def test_too_many_pixels_in_pil_input():
    policy = MediaPolicy(max_image_pixels=1000)
    assert load_image(picture(10, 100), policy).size == (10, 100)
    with pytest.raises(ValueError, match='more than the limit of 1000'):
        load_image(picture(11, 100), policy)


def test_too_many_bytes(tmp_path):
    data = encode(picture(32, 32))
    path = tmp_path / 'a.png'
    path.write_bytes(data)
    assert load_image(data, MediaPolicy(max_image_bytes=len(data))).size == (32, 32)
    small = MediaPolicy(max_image_bytes=len(data) - 1, allowed_local_path=str(tmp_path))
    for source in (data, data_url(data), str(path)):
        with pytest.raises(ValueError, match=f'larger than the limit of {len(data) - 1} bytes'):
            load_image(source, small)


@pytest.fixture
def dirs(tmp_path):
    """``allowed/`` holding in.png, and next to it secret.png and ``allowed-evil/`` (a name sharing the prefix)."""
    allowed, evil = tmp_path / 'allowed', tmp_path / 'allowed-evil'
    allowed.mkdir()
    evil.mkdir()
    for path in (allowed / 'in.png', tmp_path / 'secret.png', evil / 'x.png'):
        path.write_bytes(encode(picture()))
    return tmp_path


def test_local_file_inside_allowed_directory(dirs):
    policy = MediaPolicy(allowed_local_path=str(dirs / 'allowed'))
    for source in (str(dirs / 'allowed' / 'in.png'), (dirs / 'allowed' / 'in.png').as_uri()):
        assert load_image(source, policy).tobytes() == picture().tobytes()
    assert load_image(f"file://localhost{dirs / 'allowed' / 'in.png'}", policy).size == (5, 4)
    with pytest.raises(ValueError, match="must name a local file, got host 'elsewhere'"):
        load_image(f"file://elsewhere{dirs / 'allowed' / 'in.png'}", policy)
    with pytest.raises(ValueError, match='does not exist, is not a readable file or is outside the allowed'):
        load_image(str(dirs / 'allowed' / 'missing.png'), policy)


def test_local_file_outside_allowed_directory(dirs, tmp_path_factory):
    policy = MediaPolicy(allowed_local_path=str(dirs / 'allowed'))
    other = tmp_path_factory.mktemp('other') / 'o.png'
    other.write_bytes(encode(picture()))
    os.symlink(dirs / 'secret.png', dirs / 'allowed' / 'link.png')
    for path in (other, dirs / 'allowed' / '..' / 'secret.png', dirs / 'allowed-evil' / 'x.png',
                 dirs / 'allowed' / 'link.png'):
        assert load_image(str(path), MediaPolicy.for_local_caller()).size == (5, 4)  # readable by a local caller
        with pytest.raises(ValueError, match='does not exist, is not a readable file or is outside the allowed'):
            load_image(str(path), policy)
        with pytest.raises(ValueError, match='does not exist, is not a readable file or is outside the allowed'):
            load_image(path.as_uri(), policy)


def test_local_files_refused_when_not_allowed(dirs):
    for policy in (MediaPolicy(allowed_local_path=None), MediaPolicy()):  # the default allows none
        with pytest.raises(ValueError, match='local image files are not allowed.*--allowed-local-media-path'):
            load_image(str(dirs / 'allowed' / 'in.png'), policy)


def test_other_sources_are_explained():
    for source in ('ftp://example.com/a.png', 'gopher:x', '', 12):
        with pytest.raises(ValueError, match='must be a PIL image, bytes, a data:image.*local file path, got'):
            load_image(source)


@pytest.fixture(scope='module')
def server():
    """A real http server on 127.0.0.1: /img.png, /missing (404), /redirect (302), /big (64 MiB), /slow (drips)."""
    png = encode(picture(seed=3))
    state = {'big_sent': 0, 'big_done': threading.Event()}

    class Handler(BaseHTTPRequestHandler):

        def log_message(self, *args):
            pass

        def do_GET(self):
            if self.path == '/img.png':
                self.reply(200, png)
            elif self.path == '/redirect':
                self.send_response(302)
                self.send_header('Location', '/img.png')
                self.end_headers()
            elif self.path == '/big':
                self.send_response(200)
                self.send_header('Content-Length', str(BIG_BODY))
                self.end_headers()
                try:
                    while state['big_sent'] < BIG_BODY:
                        self.wfile.write(b'\0' * 2**16)
                        state['big_sent'] += 2**16
                except OSError:
                    pass
                finally:
                    state['big_done'].set()
            elif self.path == '/slow':
                self.send_response(200)
                self.send_header('Content-Length', '50')
                self.end_headers()
                try:
                    for _ in range(50):
                        self.wfile.write(b'\0')
                        self.wfile.flush()
                        time.sleep(0.1)
                except OSError:
                    pass
            else:
                self.reply(404, b'not found')

        def reply(self, status: int, body: bytes):
            self.send_response(status)
            self.send_header('Content-Length', str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(('127.0.0.1', 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={'poll_interval': 0.05}, daemon=True)
    thread.start()
    yield f'http://127.0.0.1:{httpd.server_port}', png, state
    httpd.shutdown()
    httpd.server_close()
    thread.join()


def test_http_allowed_domains(server):
    base, png, _ = server
    expected = picture(seed=3).tobytes()
    for domains in (('127.0.0.1',), ('example.com', '127.0.0.1'), ('*',), None):
        policy = MediaPolicy(allowed_domains=domains, allow_private_hosts=True)  # the test server is on loopback
        assert load_image(f'{base}/img.png', policy).tobytes() == expected


def test_http_refused_domains(server):
    base, _, _ = server
    for domains in (('example.com',), (), ('0.0.1',)):
        with pytest.raises(ValueError, match="domain '127.0.0.1' is not allowed.*--allowed-media-domains"):
            load_image(f'{base}/img.png', MediaPolicy(allowed_domains=domains, allow_private_hosts=True))
    with pytest.raises(ValueError, match="domain '127.0.0.1' is not allowed"):
        load_image(f'{base}/img.png')  # the default allows no host


def test_http_subdomains_match_but_lookalikes_do_not():
    policy = MediaPolicy(allowed_domains=('Example.invalid',), fetch_timeout=2)
    for url in ('http://example.invalid/a.png', 'http://img.EXAMPLE.invalid/a.png'):
        with pytest.raises(ValueError, match='could not fetch'):  # allowed, but .invalid never resolves
            load_image(url, policy)
    for url in ('http://badexample.invalid/a.png', 'http://example.invalid.evil.test/a.png'):
        with pytest.raises(ValueError, match='is not allowed'):
            load_image(url, policy)


def test_http_errors(server):
    base, _, _ = server
    policy = MediaPolicy(allowed_domains=('*',), allow_private_hosts=True)
    with pytest.raises(ValueError, match='could not fetch.*the host did not answer with an image') as error:
        load_image(f'{base}/missing', policy)
    assert '404' not in str(error.value)  # the upstream status is not echoed
    assert load_image(f'{base}/redirect', policy).size == (5, 4)  # a redirect within the policy is followed


def test_http_oversized_body_stops_reading(server):
    base, _, state = server
    with pytest.raises(ValueError, match='larger than the limit of 100000 bytes'):
        load_image(f'{base}/big', MediaPolicy(max_image_bytes=100_000, allowed_domains=('*',),
                                              allow_private_hosts=True))
    assert state['big_done'].wait(10)
    assert state['big_sent'] < BIG_BODY // 2  # the client hung up long before the end


def test_http_slow_body_times_out(server):
    base, _, _ = server
    start = time.monotonic()
    with pytest.raises(ValueError, match='timed out'):
        load_image(f'{base}/slow', MediaPolicy(fetch_timeout=0.5, allowed_domains=('*',), allow_private_hosts=True))
    assert time.monotonic() - start < 2
