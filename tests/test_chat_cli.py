"""``lmdeploy chat`` in a real pseudo-terminal."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

PROMPT = '>>> '


def quit_cleanly(child: pexpect.spawn) -> None:
    """Types ``exit`` and checks the chat ends with status 0."""
    child.send('exit\r')
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def start_chat(model: str, cache: Path, *flags: str) -> pexpect.spawn:
    """``lmdeploy chat`` on ``model`` in a pseudo-terminal, starting: its prompt is not waited for."""
    env = {**os.environ, 'PROMPT_TOOLKIT_NO_CPR': '1', 'TERM': 'dumb', 'LMDEPLOY_CACHE_DIR': str(cache)}
    # Ctrl-C makes the terminal drop its pending output, which can cut a multi-byte character in two.
    return pexpect.spawn(sys.executable, ['-m', 'lmdeploy.cli.main', 'chat', model, '--dtype', 'float32',
                                          '--num-gpu-blocks', '128', '--block-size', '16', *flags],
                         env=env, encoding='utf-8', codec_errors='replace', timeout=60, dimensions=(40, 200))


def long_llama(tiny_llama: str, folder: Path) -> str:
    """The tiny Llama with a 64k context, so that a reply can run long enough to be interrupted."""
    path = shutil.copytree(tiny_llama, folder / 'long_llama')
    config = json.loads((path / 'config.json').read_text())
    config['max_position_embeddings'] = 65536
    (path / 'config.json').write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope='module')
def chats(tiny_llama, tmp_path_factory) -> dict[str, tuple[pexpect.spawn | subprocess.Popen, Path]]:
    """The file's chats, each with its cache folder, started side by side (a chat's start is most of each test):
    four in a pseudo-terminal and one reading piped input."""
    from vl_models import save_tiny_vl_model
    folders = {name: tmp_path_factory.mktemp('chat') for name in ('text', 'ctrl_c', 'image', 'session_len', 'piped')}
    vl_model = save_tiny_vl_model('qwen2_vl', str(folders['image'] / 'qwen2_vl'))
    eight = ('--max-new-tokens', '8', '--ignore-eos')
    children = {
        'text': start_chat(tiny_llama, folders['text'], *eight),
        'ctrl_c': start_chat(long_llama(tiny_llama, folders['ctrl_c']), folders['ctrl_c'], '--max-new-tokens', '60000',
                             '--ignore-eos', '--num-gpu-blocks', '4096'),
        'image': start_chat(vl_model, folders['image'], *eight),
        'session_len': start_chat(tiny_llama, folders['session_len'], *eight, '--session-len', '64'),
        'piped': subprocess.Popen([sys.executable, '-m', 'lmdeploy.cli.main', 'chat', tiny_llama, '--dtype',
                                   'float32', '--num-gpu-blocks', '64', '--block-size', '16', '--max-new-tokens', '2',
                                   '--ignore-eos'], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, 'LMDEPLOY_CACHE_DIR': str(folders['piped'])}),
    }
    yield {name: (child, folders[name]) for name, child in children.items()}
    for child in children.values():
        if isinstance(child, pexpect.spawn):
            child.close(force=True)
        else:
            child.kill()
            child.wait()


def ready(chats: dict, name: str) -> pexpect.spawn:
    """The chat ``name`` once it shows its prompt (the file's chats start together: a longer wait than a reply's)."""
    child = chats[name][0]
    child.expect_exact(PROMPT, timeout=180)
    return child


def test_reply_multiline_history_reset_image_refused_exit(chats):
    """One chat on a text model (a chat's start is the slow part): a multi-line message, ``reset``, and an
    ``/image`` it refuses."""
    child = ready(chats, 'text')
    child.send('Hello\\\r')
    child.send('world\r')
    child.expect_exact(PROMPT)
    child.send('reset\r')
    child.expect_exact('[new conversation]')
    child.expect_exact(PROMPT)
    child.send('/image /tmp/cat.png\r')
    child.expect_exact('[error: this model does not accept images]')
    child.expect_exact(PROMPT)
    quit_cleanly(child)
    history = (chats['text'][1] / 'chat_history').read_text()
    assert '+Hello\n+world' in history and '+reset' in history


def test_ctrl_c_stops_the_reply_only(chats):
    child = ready(chats, 'ctrl_c')
    child.send('Tell me everything\r')
    child.expect_exact('everything')
    time.sleep(1.0)
    child.sendintr()
    child.expect_exact('[interrupted: the partial reply stays in the conversation]')
    child.expect_exact(PROMPT)
    quit_cleanly(child)


def test_image_command_and_an_image_failing_at_send_time(chats):
    """``/image`` attaches an image to the next message; a missing one is refused at once, and one gone
    by the time the message is sent fails that message only: the next one works."""
    from test_vl import IMAGES, png_bytes

    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    folder = chats['image'][1]
    model = str(folder / 'qwen2_vl')
    image = folder / 'cat.png'
    image.write_bytes(png_bytes(IMAGES[0]))
    with pipeline(model, PytorchEngineConfig(dtype='float32', num_gpu_blocks=32, block_size=16),
                  show_progress=False) as pipe:
        expected = pipe(('describe', str(image)), gen_config=GenerationConfig(max_new_tokens=8, ignore_eos=True))
    child = ready(chats, 'image')
    child.send(f'/image {folder}/missing.png\r')
    child.expect_exact('[error:')
    child.expect_exact(PROMPT)
    child.send(f'/image {image}\r')
    child.expect_exact(f'[image 1 attached: {image}]')
    child.expect_exact(PROMPT)
    child.send('describe\r')
    child.expect_exact(PROMPT)
    from lmdeploy.cli.chat import shown
    assert child.before.replace('\r\n', '\n').strip().endswith(shown(expected.text).strip())
    gone = folder / 'gone.png'
    gone.write_bytes(png_bytes(IMAGES[0]))
    child.send(f'/image {gone}\r')
    child.expect_exact(f'[image 1 attached: {gone}]')
    child.expect_exact(PROMPT)
    gone.unlink()  # gone before the message is sent
    child.send('describe\r')
    child.expect_exact('[error:')
    child.expect_exact(PROMPT)
    child.send('hello\r')  # the failed message is not in the history: this one works
    child.expect_exact(PROMPT)
    assert '[error' not in child.before and 'Traceback' not in child.before
    quit_cleanly(child)


def test_conversation_outgrowing_session_len_drops_oldest_turns(chats):
    child = ready(chats, 'session_len')
    for i in range(6):
        child.send(f'Hello world {i}\r')
        if child.expect_exact(['[the conversation outgrew session_len (64 tokens): left out the oldest', PROMPT]) == 0:
            child.expect_exact(PROMPT)
            break
    else:
        pytest.fail('the conversation never outgrew session_len')
    assert '[error' not in child.before and 'Traceback' not in child.before
    child.send('Hello again\r')  # the conversation goes on
    child.expect_exact(PROMPT)
    assert '[error' not in child.before
    child.send('Hello world ' * 40 + '\r')  # too long on its own: an error, and the chat goes on
    child.expect_exact('[error: the prompt has')
    child.expect_exact(PROMPT)
    child.send('Hello\r')
    child.expect_exact(PROMPT)
    assert '[error' not in child.before
    quit_cleanly(child)


def test_an_interrupted_reply_stays_in_the_conversation(monkeypatch, capsys):
    """Ctrl-C mid-reply: the next message is sent after the partial reply, so it can refer to it."""
    import asyncio
    import io
    import signal
    from types import SimpleNamespace

    from lmdeploy.cli.chat import chat
    from lmdeploy.messages import GenerationConfig

    class Engine:
        """Streams 'word ' chunks; the first reply gets a SIGINT (as Ctrl-C sends) after three of them."""

        session_len = 4096
        processor = SimpleNamespace(accepts_images=False)

        def __init__(self):
            self.prompts: list[list[dict]] = []
            self.conversation = SimpleNamespace(session_id=1, history=[])

        def session(self):
            return self.conversation

        async def end_session(self, session_id: int) -> None:
            pass

        async def generate(self, messages, session_id, gen_config, reasoning_parser=None):
            self.prompts.append([dict(m) for m in messages])
            for i in range(200):
                if len(self.prompts) == 1 and i == 3:
                    os.kill(os.getpid(), signal.SIGINT)
                await asyncio.sleep(0.01)
                yield SimpleNamespace(text='word ', reasoning_content=None,
                                      finish_reason='length' if i == 199 else None, error=None)
                if len(self.prompts) > 1:
                    yield SimpleNamespace(text='', reasoning_content=None, finish_reason='stop', error=None)
                    return

    engine = Engine()
    monkeypatch.setattr(sys, 'stdin', io.StringIO('Tell me a story\nSummarize that story\n'))
    asyncio.run(chat(engine, GenerationConfig()))
    assert '[interrupted: the partial reply stays in the conversation]' in capsys.readouterr().out
    first, second = engine.prompts
    assert first == [{'role': 'user', 'content': 'Tell me a story'}]
    assert [m['role'] for m in second] == ['user', 'assistant', 'user'] and second[2]['content'] == 'Summarize that story'
    assert second[1]['content'].startswith('word word word')


def test_commands_are_whole_lines_and_unknown_ones_never_reach_the_model(chats):
    """Piped input (no terminal): '/exit' and '/help' went to the model as messages, and '/images x' was the
    command '/image' with the image 's x'. Unknown ``/word`` lines are refused; 'exit' with more words is a message;
    blank, control-character and over-long lines leave the chat going."""
    lines = ['', '   ', '/images x', '/help', 'exit strategies?', 'a\x00b\x07\x1b[31m', 'x ' * 3000, '/exit', 'Hi']
    done = chats['piped'][0]
    stdout, stderr = done.communicate('\n'.join(lines), timeout=120)
    assert done.returncode == 0, stderr
    out = stdout
    assert "[unknown command: /images x] Type a message; 'reset' starts over" in out
    assert out.count("'/help' shows this") == 3  # the greeting, /help and the unknown command
    assert 'session_len is 1024' in out  # the long line is refused, the chat goes on
    assert out.count(PROMPT) == 8, out  # the chat stops at '/exit': 'Hi' is never read


def test_a_reply_cannot_send_escape_sequences_to_the_terminal(capsys):
    from lmdeploy.cli.chat import ReplyPrinter
    printer = ReplyPrinter(show_reasoning=True)
    printer.start()
    printer.write('\x1b]52;c;cHduZWQ=\x07', '')
    printer.write('', 'safe\x1b[2J\x1b]0;pwned\x07\r\x9b1A\tdone\n')
    out = capsys.readouterr().out
    assert not set(out) & {'\x1b', '\x07', '\r', '\x9b'}
    assert '\\x1b]52;c;cHduZWQ=\\x07' in out
    assert out.endswith('safe\\x1b[2J\\x1b]0;pwned\\x07\\x0d\\x9b1A\tdone\n')
