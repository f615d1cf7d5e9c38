"""``lmdeploy chat [MODEL]``: an interactive terminal chat that streams its replies."""
from __future__ import annotations

import argparse

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument('model_path', nargs='?', default=None,
                        help='local Hugging Face folder or .gguf file (default: the bundled SmolLM2-135M-Instruct)')
    parser.add_argument('--dtype', default='auto', choices=['auto', 'float32', 'bfloat16', 'float16'])
    parser.add_argument('--session-len', type=int, default=None)
    parser.add_argument('--max-batch-size', type=int, default=64)
    parser.add_argument('--cache-max-entry-count', type=float, default=0.5)
    parser.add_argument('--block-size', type=int, default=64)


def engine_config(args: argparse.Namespace) -> PytorchEngineConfig:
    return PytorchEngineConfig(dtype=args.dtype, session_len=args.session_len, max_batch_size=args.max_batch_size,
                               cache_max_entry_count=args.cache_max_entry_count, block_size=args.block_size)


def add_chat_parser(commands) -> None:
    parser = commands.add_parser('chat', help='chat with a model in the terminal')
    add_engine_args(parser)
    parser.add_argument('--max-new-tokens', type=int, default=512)
    parser.add_argument('--temperature', type=float, default=0.0, help='0 means greedy decoding')
    parser.add_argument('--top-p', type=float, default=1.0)
    parser.add_argument('--top-k', type=int, default=0)
    parser.add_argument('--seed', type=int, default=None)
    parser.set_defaults(run=run_chat)


def run_chat(args: argparse.Namespace) -> None:
    from lmdeploy.api import pipeline
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0,
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, random_seed=args.seed)
    pipe = pipeline(args.model_path, backend_config=engine_config(args))
    messages: list[dict] = []
    print("Type a message; 'reset' starts over, 'exit' quits.")
    while True:
        try:
            prompt = input('\n>>> ').strip()
        except EOFError:
            break
        if prompt == 'exit':
            break
        if prompt == 'reset':
            messages = []
            continue
        if not prompt:
            continue
        messages.append({'role': 'user', 'content': prompt})
        reply = ''
        for chunk in pipe.stream_infer([messages], gen_config=gen):
            print(chunk.text, end='', flush=True)
            reply += chunk.text
        print()
        messages.append({'role': 'assistant', 'content': reply})
    pipe.close()
