"""The chat page at ``/`` in a real browser: Playwright driving the system's Chromium (Debian's ``chromium``
package; CI installs it, see .ci/run) against a real uvicorn server on 127.0.0.1."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from server_helpers import ServerThread, serve, slow_down, tiny_engine
from test_vl import IMAGES, png_bytes
from vl_models import save_tiny_vl_model

from lmdeploy.serve.openai.api_server import create_app

SCREENSHOT = Path(__file__).parent.parent / 'docs' / 'chat_page.png'
REPLY = '.message.assistant'


@pytest.fixture(scope='module')
def browser() -> Browser:
    executable = shutil.which('chromium') or shutil.which('chromium-browser')
    assert executable, 'the chat page tests need Chromium: apt-get install -y chromium'
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=['--no-sandbox'])
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Page:
    context = browser.new_context(viewport={'width': 1000, 'height': 700})
    yield context.new_page()
    context.close()


@pytest.fixture(scope='module')
def slow_server(tiny_llama):
    """The tiny Llama, each step 40 ms slower, so that a reply streams for a while."""
    engine = tiny_engine(tiny_llama)
    slow_down(engine, 0.04)
    yield from serve(engine, model_name='tiny')


def settings(page: Page, max_tokens: int, temperature: str = '') -> None:
    page.click('#settings-toggle')
    page.fill('#max-tokens', str(max_tokens))
    page.fill('#temperature', temperature)
    page.click('#settings-toggle')


def send(page: Page, text: str) -> None:
    page.fill('#prompt', text)
    page.press('#prompt', 'Enter')


def test_a_reply_streams_in_and_the_conversation_stays(page: Page, slow_server):
    page.goto(slow_server.url)
    expect(page.locator('#model')).to_have_text('tiny')
    settings(page, 30, '0')
    send(page, 'Hello world')
    reply = page.locator(REPLY).last
    expect(page.locator('#stop')).to_be_visible()  # still streaming...
    expect(reply.locator('.body')).not_to_be_empty()  # ...and text has arrived
    assert page.locator('#stop').is_visible()
    expect(reply.locator('.meta')).to_contain_text('finish: ', timeout=60_000)
    meta = reply.locator('.meta').inner_text()
    assert 'tokens/s' in meta and ('finish: length' in meta or 'finish: stop' in meta), meta
    text = reply.locator('.body').inner_text()
    page.reload()  # the conversation is kept in the browser
    expect(page.locator('.message.user')).to_have_text('Hello world')
    assert page.locator(REPLY).last.locator('.body').inner_text() == text
    page.click('#new-chat')
    expect(page.locator('.message')).to_have_count(0)


def test_stop_aborts_the_request(page: Page, slow_server):
    page.goto(slow_server.url)
    settings(page, 2000, '0')
    send(page, 'Tell me a long story')
    reply = page.locator(REPLY).last
    expect(reply.locator('.body')).not_to_be_empty()
    page.click('#stop')
    expect(reply.locator('.meta')).to_contain_text('finish: stopped')
    expect(page.locator('#send')).to_be_visible()
    state = slow_server.app.state.server
    deadline = time.monotonic() + 30
    while state.admission.running and time.monotonic() < deadline:  # the server aborted the generation
        time.sleep(0.1)
    assert state.admission.running == 0
    assert len(reply.locator('.body').inner_text()) > 0


def test_markdown_is_rendered_and_escaped(page: Page, slow_server):
    page.goto(slow_server.url)
    source = ("# Title\n\nSome **bold** and `a<b`\n\n```python\nif x < 1:\n    print('<script>')\n```\n"
              '- one\n- two\n\n<img src=x onerror=alert(1)> [a link](https://example.com) [bad](javascript:alert(1))')
    html = page.evaluate('(source) => renderMarkdown(source)', source)
    assert '<h1>Title</h1>' in html and '<strong>bold</strong>' in html and '<code>a&lt;b</code>' in html
    assert '<pre><code class="language-python">if x &lt; 1:\n    print(&#39;&lt;script&gt;&#39;)</code></pre>' in html
    assert '<ul><li>one</li><li>two</li></ul>' in html and '<img' not in html and '&lt;img src=x' in html
    assert '<a href="https://example.com" target="_blank" rel="noopener noreferrer">a link</a>' in html
    assert 'href="javascript' not in html


def test_the_page_asks_for_the_api_key(page: Page, tiny_llama):
    engine = tiny_engine(tiny_llama)
    server = ServerThread(create_app(engine, model_name='tiny', api_keys=['secret-key']))
    try:
        page.goto(server.url)
        expect(page.locator('#key-form')).to_be_visible()
        page.fill('#api-key', 'secret-key')
        page.click('#key-form button')
        expect(page.locator('#model')).to_have_text('tiny')
        expect(page.locator('#key-form')).to_be_hidden()
        settings(page, 5, '0')
        send(page, 'Hello')
        expect(page.locator(REPLY).last.locator('.meta')).to_contain_text('finish: ', timeout=60_000)
        assert page.evaluate("sessionStorage.getItem('lmdeploy.apiKey')") == 'secret-key'
        assert page.evaluate("localStorage.getItem('lmdeploy.apiKey')") is None
    finally:
        server.stop()
        engine.close()


def test_no_web_ui(tiny_llama):
    engine = tiny_engine(tiny_llama)
    server = ServerThread(create_app(engine, model_name='tiny', web_ui=False))
    try:
        assert httpx.get(f'{server.url}/').status_code == 404
        assert httpx.get(f'{server.url}/web/app.js').status_code == 404
    finally:
        server.stop()
        engine.close()


def test_an_image_goes_to_a_vision_model(page: Page, tmp_path: Path):
    model = save_tiny_vl_model('qwen2_vl', str(tmp_path / 'qwen2_vl'))
    engine = tiny_engine(model)
    server = ServerThread(create_app(engine, model_name='tiny-vl'))
    image = tmp_path / 'cat.png'
    image.write_bytes(png_bytes(IMAGES[0]))
    try:
        page.goto(server.url)
        expect(page.locator('#model')).to_have_text('tiny-vl')
        settings(page, 4, '0')
        page.set_input_files('#image-input', str(image))
        expect(page.locator('#attachments img')).to_have_count(1)
        with page.expect_request('**/v1/chat/completions') as request:
            send(page, 'What is in the picture?')
        messages = request.value.post_data_json['messages']
        assert len(messages) == 1 and messages[0]['role'] == 'user'
        parts = messages[0]['content']
        assert parts[0]['type'] == 'image_url' and parts[0]['image_url']['url'].startswith('data:image/png;base64,')
        assert parts[1] == {'type': 'text', 'text': 'What is in the picture?'}
        reply = page.locator(REPLY).last
        expect(reply.locator('.meta')).to_contain_text('finish: ', timeout=60_000)
        assert 'error' not in reply.get_attribute('class')
        expect(page.locator('.message.user img')).to_have_count(1)
    finally:
        server.stop()
        engine.close()


@pytest.mark.slow
def test_a_conversation_with_the_default_model(page: Page):
    """The default model, greedy (temperature 0 in the settings, so that the answer is always the same), answers
    in Markdown; ``LMDEPLOY_SCREENSHOT=1`` saves the page as docs/chat_page.png."""
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.serve.async_engine import AsyncEngine
    engine = AsyncEngine(None, PytorchEngineConfig(num_gpu_blocks=64), show_progress=False)
    server = ServerThread(create_app(engine))
    try:
        page.goto(server.url)
        expect(page.locator('#model')).to_have_text('SmolLM2-135M-Instruct')
        page.click('#settings-toggle')
        page.fill('#system-prompt', 'You are a helpful assistant.')
        page.fill('#max-tokens', '120')
        page.fill('#temperature', '0')
        page.click('#settings-toggle')
        send(page, 'What is the capital of France?')
        expect(page.locator(REPLY).last.locator('.meta')).to_contain_text('finish: ', timeout=120_000)
        assert 'Paris' in page.locator(REPLY).last.inner_text()
        send(page, 'Write a Python function that adds two numbers.')
        expect(page.locator(REPLY).nth(1).locator('.meta')).to_contain_text('finish: ', timeout=120_000)
        expect(page.locator(REPLY).nth(1).locator('pre code')).to_contain_text('def ')
        if os.environ.get('LMDEPLOY_SCREENSHOT') == '1':
            page.screenshot(path=str(SCREENSHOT), full_page=True)
    finally:
        server.stop()
        engine.close()
