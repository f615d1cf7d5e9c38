"""CPU time the tool-call parsers take to read one long call as it streams (single thread, ``time.process_time``).

A call writing a file of about 24,000 characters is fed to each parser in 4- and 64-character pieces (a piece is
about a token's text, or a stream chunk); the best of 3 rounds is printed as the whole reply's time and the time
per piece::

    python benchmark/tool_parsers_cpu.py
"""
from __future__ import annotations

import json
import time

from lmdeploy.serve.openai.tool_parsers import get_tool_parser

TOOLS = [{'type': 'function', 'function': {'name': 'write', 'parameters': {'type': 'object', 'properties': {
    'path': {'type': 'string'}, 'content': {'type': 'string'}, 'lines': {'type': 'array'}}}}}]
BODY = ''.join(f'line {i}: x = "{i}" < y\n' for i in range(1000))
CALL = {'name': 'write', 'arguments': {'path': 'a.py', 'content': BODY}}
REPLIES = {
    'qwen3_coder': ('Writing.\n<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n'
                    f'<parameter=content>\n{BODY}\n</parameter>\n</function>\n</tool_call>'),
    'qwen3_coder, typed value': ('<tool_call>\n<function=write>\n<parameter=lines>\n' + json.dumps(BODY.splitlines())
                                 + '\n</parameter>\n</function>\n</tool_call>'),
    'granite': f'<|tool_call|>[{json.dumps(CALL)}]',
    'pythonic': f'[write(path="a.py", content={BODY!r})]',
    'hermes': f'<tool_call>\n{json.dumps(CALL)}\n</tool_call>',
}


def seconds(name: str, reply: str, piece: int) -> tuple[float, int]:
    """The best CPU time of 3 rounds reading ``reply`` in pieces of ``piece`` characters, and the pieces."""
    parser_class, best = get_tool_parser(name.split(',')[0]), float('inf')
    pieces = [reply[i:i + piece] for i in range(0, len(reply), piece)]
    for _ in range(3):
        parser = parser_class(TOOLS)
        start = time.process_time()
        for text in pieces:
            parser.feed(text)
        parser.finish()
        best = min(best, time.process_time() - start)
    return best, len(pieces)


def main() -> None:
    for name, reply in REPLIES.items():
        for piece in (4, 64):
            spent, count = seconds(name, reply, piece)
            print(f'{name:25s} {len(reply):6d} chars in {piece:2d}-char pieces ({count:4d}): '
                  f'{spent * 1e3:6.1f} ms CPU, {spent / count * 1e6:5.1f} us a piece')


if __name__ == '__main__':
    main()
