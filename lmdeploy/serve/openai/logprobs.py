"""Engine logprobs (per token: ``{token_id: logprob}``, the chosen token first) in OpenAI's two schemas."""
from __future__ import annotations

from lmdeploy.tokenizer import Tokenizer


def _text(tokenizer: Tokenizer, token_id: int, skip_special_tokens: bool = False) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float]] | None,
                  top: int) -> dict | None:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` of the chat schema."""
    if logprobs is None:
        return None
    content = []
    for token_id, entry in zip(token_ids, logprobs):
        text = _text(tokenizer, token_id)
        content.append({'token': text, 'logprob': entry[token_id], 'bytes': list(text.encode()),
                        'top_logprobs': [{'token': (t := _text(tokenizer, tid)), 'logprob': lp,
                                          'bytes': list(t.encode())} for tid, lp in _top(entry, top)]})
    return {'content': content}


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], logprobs: list[dict[int, float] | None] | None,
                        top: int, offset: int, skip_special_tokens: bool = False) -> dict | None:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` of the completions schema;
    ``offset`` is where the first token's text starts in the choice's text. A None entry (the first
    prompt token's) has null logprobs."""
    if logprobs is None:
        return None
    out: dict[str, list] = {'tokens': [], 'token_logprobs': [], 'top_logprobs': [], 'text_offset': []}
    for token_id, entry in zip(token_ids, logprobs):
        text = _text(tokenizer, token_id, skip_special_tokens)
        out['tokens'].append(text)
        out['token_logprobs'].append(None if entry is None else entry[token_id])
        out['top_logprobs'].append(None if entry is None else
                                   {_text(tokenizer, tid): lp for tid, lp in _top(entry, top)})
        out['text_offset'].append(offset)
        offset += len(text)
    return out


def join_logprobs(prefix: dict | None, rest: dict | None) -> dict | None:
    """Completions-schema logprobs of ``prefix``'s tokens followed by ``rest``'s (either may be None)."""
    if prefix is None or rest is None:
        return rest if prefix is None else prefix
    return {key: prefix[key] + rest[key] for key in prefix}

