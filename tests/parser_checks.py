"""Checks of the chat reply parsers on text: every chunking of a reply must give the same message, and the
same places of the reasoning in the reply (which ``usage`` counts the reasoning tokens by)."""
from __future__ import annotations

import random


def chunkings(text: str, seed: int = 0, count: int = 30):
    """The whole text, one character at a time, and ``count`` random chunkings."""
    yield [text]
    yield list(text)
    rng = random.Random(seed)
    for _ in range(count):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def streamed(make, pieces: list[str]) -> dict:
    """What a client that accumulates OpenAI stream deltas ends with."""
    parser = make()
    message = {'reasoning': '', 'content': '', 'calls': {}}
    for i, piece in enumerate(pieces + ['']):
        delta = parser.feed(piece, final=i == len(pieces))
        message['reasoning'] += delta.reasoning
        message['content'] += delta.content
        for entry in parser.delta_body(delta).get('tool_calls', []):
            call = message['calls'].setdefault(entry['index'], {'name': '', 'arguments': '', 'ids': 0})
            call['ids'] += 'id' in entry
            call['name'] += entry['function'].get('name', '')
            call['arguments'] += entry['function']['arguments']
    message['spans'] = parser.reasoning.reasoning_spans if parser.reasoning else []
    return message


def split(make, text: str) -> dict:
    """The message of ``text`` (checked to be the same for every chunking); calls as (name, arguments)."""
    results = [streamed(make, pieces) for pieces in chunkings(text)]
    assert all(r == results[0] for r in results)
    parser = make()
    message = parser.message(text)
    first = results[0]
    assert (parser.reasoning.reasoning_spans if parser.reasoning else []) == first['spans']
    ends = [end for span in first['spans'] for end in span]
    assert ends == sorted(ends) and all(a < b for a, b in first['spans']) and (not ends or ends[-1] <= len(text))
    assert all(c['ids'] == 1 for c in first['calls'].values())
    calls = [(c['name'], c['arguments']) for _, c in sorted(first['calls'].items())]
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls or []] == calls
    assert (message.content or '') == first['content'] and (message.reasoning_content or '') == first['reasoning']
    return {'reasoning': first['reasoning'], 'content': first['content'], 'calls': calls}
