"""``MultiModalProcessor``: a prompt (text or OpenAI messages) to token ids; text-only for now."""
from __future__ import annotations

from typing import Union

from lmdeploy.tokenizer import Tokenizer

Messages = list[dict]
Prompt = Union[str, Messages]
IMAGE_PART_TYPES = ('image', 'image_url', 'input_image')


def _text_of(content: object, index: int) -> str:
    """The text of a message's ``content``: a str, None, or a list of ``{'type': 'text', ...}`` parts."""
    if content is None or isinstance(content, str):
        return content or ''
    if not isinstance(content, list):
        raise ValueError(f'message {index}: content must be a str or a list of parts, got {type(content).__name__}')
    texts = []
    for part in content:
        kind = part.get('type') if isinstance(part, dict) else None
        if kind in IMAGE_PART_TYPES:
            raise ValueError(f'message {index}: this model does not accept images')
        if kind != 'text' or not isinstance(part.get('text'), str):
            raise ValueError(f"message {index}: a content part must be {{'type': 'text', 'text': str}}, got {part!r}")
        texts.append(part['text'])
    return '\n'.join(texts)


def normalize_messages(messages: Messages) -> Messages:
    """Checks OpenAI-style messages and flattens list contents into plain text."""
    if not isinstance(messages, list) or not messages:
        raise ValueError('messages must be a non-empty list of {"role": ..., "content": ...} dicts')
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get('role'), str):
            raise ValueError(f'message {index} must be a dict with a str "role", got {message!r}')
        out.append({**message, 'content': _text_of(message.get('content'), index)})
    return out


class MultiModalProcessor:
    """Renders prompts with the chat template and tokenizes them.

    ``chat_template`` (Jinja) overrides the model's own template when given.
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    def render(self, prompt: Prompt, do_preprocess: bool = True) -> str:
        """The prompt's text: chat-templated, or as given when ``do_preprocess`` is False
        (the contents of a message list are then joined by newlines)."""
        if isinstance(prompt, str):
            if not do_preprocess:
                return prompt
            prompt = [{'role': 'user', 'content': prompt}]
        messages = normalize_messages(prompt)
        if not do_preprocess:
            return '\n'.join(m['content'] for m in messages)
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template)

    def encode(self, prompt: Prompt, do_preprocess: bool = True) -> list[int]:
        """Token ids of a prompt; raises ``ValueError`` for malformed or image-bearing input."""
        if not isinstance(prompt, (str, list)):
            raise ValueError(f'a prompt must be a str or a list of messages, got {type(prompt).__name__}')
        text = self.render(prompt, do_preprocess)
        return self.tokenizer.encode(text, add_special_tokens=not do_preprocess)
