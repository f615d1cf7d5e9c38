"""Security of image sources in the library defaults: local files, loopback and private addresses, redirects
and DNS rebinding."""
from __future__ import annotations

import os
import time

import httpcore
import pytest
from security_fixtures import ALL, connects, fake_dns, image_host  # noqa: F401 (fixtures)
from server_helpers import tiny_engine
from test_vl import IMAGES, png_bytes

from lmdeploy.vl import media
from lmdeploy.vl.media import MediaPolicy, load_image


# ---------------------------------------------------------------------------------------------------------
# library defaults


def test_library_defaults_allow_no_url_and_no_local_file(tmp_path):
    policy = MediaPolicy()
    assert policy.allowed_domains == () and policy.allowed_local_path is None and not policy.allow_private_hosts
    path = tmp_path / 'cat.png'
    path.write_bytes(png_bytes(IMAGES[0]))
    for source in (str(path), path.as_uri(), '/etc/passwd', 'file:///etc/passwd'):
        with pytest.raises(ValueError, match='local image files are not allowed'):
            load_image(source)
    with pytest.raises(ValueError, match='is not allowed'):
        load_image('http://example.com/cat.png')
    assert load_image(png_bytes(IMAGES[0])).size == IMAGES[0].size  # bytes, PIL images, data URLs still load
    local = MediaPolicy.for_local_caller()
    assert load_image(str(path), local).size == IMAGES[0].size


def test_pipeline_opts_into_local_files_and_async_engine_does_not(tiny_llama):
    from lmdeploy import PytorchEngineConfig, pipeline
    with pipeline(tiny_llama, PytorchEngineConfig(dtype='float32', num_gpu_blocks=16, block_size=16),
                  show_progress=False) as pipe:
        assert pipe.async_engine.processor.media_policy == MediaPolicy.for_local_caller()
    engine = tiny_engine(tiny_llama, num_gpu_blocks=16)
    try:
        assert engine.processor.media_policy == MediaPolicy()
    finally:
        engine.close()


def test_local_file_errors_do_not_tell_whether_a_path_exists(tmp_path):
    allowed = tmp_path / 'allowed'
    allowed.mkdir()
    (allowed / 'sub').mkdir()
    (tmp_path / 'outside.png').write_bytes(png_bytes(IMAGES[0]))
    os.mkfifo(allowed / 'fifo')
    policy = MediaPolicy(allowed_local_path=str(allowed))
    paths = [tmp_path / 'outside.png', tmp_path / 'no-such.png', allowed / 'no-such.png', allowed / 'sub',
             allowed / 'fifo', '/etc/passwd', '/etc/no-such-file']
    messages = set()
    for path in paths:
        start = time.monotonic()
        with pytest.raises(ValueError) as error:
            load_image(str(path), policy)
        assert time.monotonic() - start < 5  # a FIFO does not block
        messages.add(str(error.value).replace(repr(str(path)), 'PATH'))
    assert messages == {'cannot read image file PATH: it does not exist, is not a readable file or is outside '
                        'the allowed directory'}


def test_non_public_addresses_are_refused_before_connecting(connects):
    for host in ('127.0.0.1', '127.1.2.3', '[::1]', '[::ffff:127.0.0.1]', '10.0.0.1', '172.16.5.4', '192.168.1.1',
                 '169.254.169.254', '100.64.0.1', '0.0.0.0', '224.0.0.1', '240.0.0.1', '[fe80::1]', '[fc00::1]',
                 '[2002:7f00:1::1]', 'localhost'):
        with pytest.raises(ValueError, match='unknown or not a public address.*--allow-private-media-hosts'):
            load_image(f'http://{host}:9/cat.png', ALL)
    assert connects == []
    for address in ('8.8.8.8', '2606:4700:4700::1111', '93.184.215.14'):
        assert media._is_public(media.ipaddress.ip_address(address))


def test_private_hosts_allowed_only_by_the_flag(image_host):
    port, _ = image_host
    with pytest.raises(ValueError, match='not a public address'):
        load_image(f'http://127.0.0.1:{port}/cat.png', ALL)
    opted_in = MediaPolicy(allowed_domains=('*',), allow_private_hosts=True)
    assert load_image(f'http://127.0.0.1:{port}/cat.png', opted_in).tobytes() == IMAGES[0].tobytes()


def test_names_resolving_to_private_addresses_are_refused(fake_dns, connects):
    names, _ = fake_dns
    names['intranet.example.test'] = ['10.1.2.3']
    names['mixed.example.test'] = ['93.184.215.14', '127.0.0.1']  # one bad answer is enough
    policy = MediaPolicy(allowed_domains=('example.test',))
    for host in ('intranet.example.test', 'mixed.example.test'):
        with pytest.raises(ValueError, match='unknown or not a public address') as error:
            load_image(f'http://{host}/cat.png', policy)
        assert '10.1.2.3' not in str(error.value) and '127.0.0.1' not in str(error.value)
    assert connects == []


def test_connects_to_the_address_it_checked(fake_dns, monkeypatch):
    """DNS rebinding: the first answer is public, later ones loopback; the loader must not look again."""
    names, lookups = fake_dns
    names['rebind.example.test'] = [['93.184.215.14'], ['127.0.0.1']]
    connects = []

    def refuse_network(self, host, port, *args, **kwargs):  # no network in tests: record, then fail
        connects.append(host)
        raise httpcore.ConnectError('no network in tests')

    monkeypatch.setattr(httpcore.SyncBackend, 'connect_tcp', refuse_network)
    with pytest.raises(ValueError, match='could not fetch image') as error:
        load_image('http://rebind.example.test/cat.png', MediaPolicy(allowed_domains=('rebind.example.test',)))
    assert connects == ['93.184.215.14'] and lookups == ['rebind.example.test']
    assert 'no network' not in str(error.value)  # connection details stay in the log


def test_redirects_are_followed_only_where_the_policy_allows(image_host, fake_dns, connects, monkeypatch):
    port, hits = image_host
    names, _ = fake_dns
    # Pretend 127.0.0.1 is public and 127.0.0.2 private: public.test is the image host, internal.test "private".
    names['public.test'] = ['127.0.0.1']
    names['internal.test'] = ['127.0.0.2']
    monkeypatch.setattr(media, '_is_public', lambda ip: str(ip) == '127.0.0.1')
    policy = MediaPolicy(allowed_domains=('public.test', 'internal.test'))
    base = f'http://public.test:{port}'
    assert load_image(f'{base}/to?/cat.png', policy).tobytes() == IMAGES[0].tobytes()
    assert load_image(f'{base}/to?{base}/cat.png', policy).tobytes() == IMAGES[0].tobytes()
    refused = {
        f'{base}/to?http://internal.test:{port}/cat.png': 'unknown or not a public address',
        f'{base}/to?http://127.0.0.1:{port}/cat.png': 'redirects to a host that is not allowed',
        f'{base}/to?file:///etc/passwd': 'redirects to a URL that is not http',
        f'{base}/loop': 'more than 5 redirects',
    }
    for url, reason in refused.items():
        with pytest.raises(ValueError, match=reason):
            load_image(url, policy)
    assert '127.0.0.2' not in connects
    assert hits.count('/loop') == 6
