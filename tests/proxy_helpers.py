"""What the proxy tests and the ``--dp`` tests share: the node flags, ``lmdeploy`` subprocesses, the
proxy's view of its nodes and streamed chats through it."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import openai

NODE_FLAGS = ['--dtype', 'float32', '--num-gpu-blocks', '256', '--block-size', '16', '--model-name', 'tiny',
              '--num-threads', '1', '--shutdown-timeout', '5']


def lmdeploy(args: list[str], log_path) -> subprocess.Popen:
    with open(log_path, 'a') as log:
        return subprocess.Popen([sys.executable, '-m', 'lmdeploy.cli.main', *args], stdout=log,
                                stderr=subprocess.STDOUT, env={**os.environ, 'PYTHONUNBUFFERED': '1'})


def status(url: str) -> dict:
    return httpx.get(f'{url}/nodes/status').json()


def healthy_nodes(url: str) -> list[str]:
    return sorted(node for node, state in status(url).items() if state['healthy'])


def per_node(samples: dict[str, float], name: str) -> dict[str, float]:
    """``name``'s samples summed per ``node`` label."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        if key.startswith(name + '{'):
            node = key.split('node="', 1)[1].split('"', 1)[0]
            out[node] = out.get(node, 0.0) + value
    return out


async def stream_texts(url: str, prompts: list[str], max_tokens: int) -> list[str]:
    async with openai.AsyncOpenAI(base_url=f'{url}/v1', api_key='none', max_retries=0) as client:
        async def one(prompt: str) -> str:
            stream = await client.chat.completions.create(model='tiny', messages=[{'role': 'user', 'content': prompt}],
                                                          max_tokens=max_tokens, stream=True,
                                                          extra_body={'ignore_eos': True})
            return ''.join([chunk.choices[0].delta.content or '' async for chunk in stream if chunk.choices])
        return await asyncio.gather(*(one(prompt) for prompt in prompts))
