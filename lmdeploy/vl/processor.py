"""``MultiModalProcessor``: a prompt (text, OpenAI messages, or text with images) to model inputs."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Union

import jinja2

from lmdeploy.pytorch.multimodal import MultiModalInput
from lmdeploy.tokenizer import Tokenizer
from lmdeploy.vl.image_inputs import ImageInputs
from lmdeploy.vl.media import MediaPolicy, image_hash, image_size, load_image

Messages = list[dict]
Prompt = Union[str, Messages, tuple]
IMAGE_PART_TYPES = ('image', 'image_url', 'input_image')
AUDIO_PART_TYPES = ('audio', 'input_audio')


@dataclass
class ProcessedPrompt:
    """Token ids (image placeholders expanded), the prompt's images in order, and its rendered text."""

    input_ids: list[int]
    multimodal: list[MultiModalInput] = field(default_factory=list)
    text: str = ''


class PromptTooLong(ValueError):
    """A prompt of at least ``tokens`` tokens, not under the ``limit`` it was given."""

    def __init__(self, tokens: int, limit: int):
        super().__init__(f'the prompt has at least {tokens} tokens, but the context limit (session_len) is {limit} '
                         'tokens, output included; shorten the prompt')
        self.tokens, self.limit = tokens, limit


def _image_source(part: dict, index: int) -> Any:
    """Where an image content part's picture comes from: a URL or path, bytes, or a PIL image."""
    source = part.get('image_url') or part.get('image') or part.get('url')
    if isinstance(source, dict):
        source = source.get('url')
    if source is None:
        raise ValueError(f"message {index}: an image part needs an 'image_url': {{'url': ...}}, got {part!r}")
    return source


def _content(content: object, index: int, images: list | None) -> str | list[dict]:
    """A message's ``content`` in the form the chat template takes: text, or (when ``images`` collects
    the pictures) a list of text and ``{'type': 'image'}`` parts."""
    if content is None or isinstance(content, str):
        return content or ''
    if not isinstance(content, list):
        raise ValueError(f'message {index}: content must be a str or a list of parts, got {type(content).__name__}')
    parts = []
    for part in content:
        kind = part.get('type') if isinstance(part, dict) else None
        if kind in IMAGE_PART_TYPES:
            if images is None:
                raise ValueError(f'message {index}: this model does not accept images')
            images.append(_image_source(part, index))
            parts.append({'type': 'image'})
        elif kind in AUDIO_PART_TYPES:
            raise ValueError(f'message {index}: this model does not accept audio')
        elif kind == 'text' and isinstance(part.get('text'), str):
            parts.append({'type': 'text', 'text': part['text']})
        else:
            raise ValueError(f"message {index}: a content part must be {{'type': 'text', 'text': str}} or an "
                             f'image part, got {part!r}')
    if images is None or all(p['type'] == 'text' for p in parts):
        return '\n'.join(p['text'] for p in parts)
    return parts


def _as_messages(prompt: Prompt) -> Messages:
    """``str`` and ``(text, image)`` / ``(text, [images])`` prompts as a one-message conversation."""
    if isinstance(prompt, str):
        return [{'role': 'user', 'content': prompt}]
    if isinstance(prompt, tuple):
        if len(prompt) != 2 or not isinstance(prompt[0], str):
            raise ValueError('a tuple prompt must be (text, image) or (text, [images])')
        text, images = prompt
        images = images if isinstance(images, list) else [images]
        return [{'role': 'user', 'content': [{'type': 'image', 'image': image} for image in images] +
                 [{'type': 'text', 'text': text}]}]
    return prompt


def _image_parts_as_text(messages: Messages, placeholder: str) -> Messages:
    """``messages`` with each list content joined into text, an image part as ``placeholder``."""
    return [{**m, 'content': ''.join(placeholder if p['type'] == 'image' else p['text'] for p in m['content'])}
            if isinstance(m['content'], list) else m for m in messages]


class MultiModalProcessor:
    """Renders prompts with the chat template, loads and preprocesses their images and tokenizes them.

    ``chat_template`` (Jinja) overrides the model's own template when given. For a vision-language
    model, ``image_inputs`` runs its transformers image processor; images load under ``media_policy``
    and at most ``max_images`` go in one prompt.
    """

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None,
                 image_inputs: ImageInputs | None = None, media_policy: MediaPolicy = MediaPolicy(),
                 max_images: int = 16):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.image_inputs = image_inputs
        self.media_policy = media_policy
        self.max_images = max_images

    @property
    def accepts_images(self) -> bool:
        return self.image_inputs is not None

    def normalize(self, messages: Messages, images: list | None = None) -> Messages:
        """Checks OpenAI-style messages and puts their contents in template form (see ``_content``)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError('messages must be a non-empty list of {"role": ..., "content": ...} dicts')
        out = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get('role'), str):
                raise ValueError(f'message {index} must be a dict with a str "role", got {message!r}')
            out.append({**message, 'content': _content(message.get('content'), index, images)})
        return out

    def render(self, prompt: Prompt, do_preprocess: bool = True, images: list | None = None,
               tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """The prompt's text: chat-templated (with ``tools`` and ``template_kwargs``), or as given when
        ``do_preprocess`` is False (the texts of a message list are then joined by newlines). Image sources
        are appended to ``images``; a template that rejects the messages raises ``ValueError``, one that takes
        only string contents gets each image as the family's ``placeholder_text`` where it has one."""
        if isinstance(prompt, str) and not do_preprocess:
            return prompt
        messages = self.normalize(_as_messages(prompt), images)
        if do_preprocess and self.template_drops_string_contents:
            messages = [{**m, 'content': [{'type': 'text', 'text': m['content']}]} if isinstance(m['content'], str)
                        else m for m in messages]
        if do_preprocess:
            try:
                return self._apply_template(messages, tools, template_kwargs)
            except TypeError as exc:  # a template that joins contents as strings (InternVL's remote-code one)
                placeholder = self.image_inputs.placeholder_text if self.image_inputs else None
                if placeholder is None or all(isinstance(m['content'], str) for m in messages):
                    raise ValueError(f'the chat template rejected the messages: {exc}') from exc
                return self._apply_template(_image_parts_as_text(messages, placeholder), tools, template_kwargs)
        return '\n'.join(m['content'] if isinstance(m['content'], str) else
                         ''.join(p.get('text', '') for p in m['content']) for m in messages)

    @cached_property
    def template_drops_string_contents(self) -> bool:
        """Whether the chat template renders a message whose content is a string without its text: SmolVLM's and
        Idefics3's read every content as a list of parts; such a template gets each string as one text part."""
        marker = 'lmdeploy: does the template keep this text?'
        try:
            return marker not in self._apply_template([{'role': 'user', 'content': marker}], None, None)
        except (ValueError, TypeError):
            return False

    def template_holds(self, word: str) -> bool:
        """Whether the text of the chat template holds ``word`` (a role's name, say)."""
        template = self.chat_template or getattr(self.tokenizer.hf, 'chat_template', None) or ''
        return word in (template if isinstance(template, str) else ' '.join(template.values()))

    def _apply_template(self, messages: Messages, tools: list[dict] | None, template_kwargs: dict | None) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, tools=tools,
                                                      **(template_kwargs or {}))
        except jinja2.TemplateError as exc:
            raise ValueError(f'the chat template rejected the messages: {exc}') from exc
        except RecursionError:
            raise ValueError('the messages nest too deeply for the chat template') from None

    def process(self, prompt: Prompt, do_preprocess: bool = True, tools: list[dict] | None = None,
                template_kwargs: dict | None = None, stop: threading.Event | None = None,
                token_limit: int | None = None) -> ProcessedPrompt:
        """Token ids and images of a prompt (see :meth:`render` for ``tools`` and ``template_kwargs``);
        raises ``ValueError`` for malformed input or bad images. Once ``stop`` is set (the caller no longer
        waits), no further image is loaded or preprocessed: it raises ``ValueError`` then. A prompt with images
        that will not be shorter than ``token_limit`` tokens raises :class:`PromptTooLong` as soon as that is
        known: before any image is loaded when its text, and the token counts its images' headers give, reach
        it; else after the image that makes it reach it."""
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(f'a prompt must be a str, a list of messages or a (text, images) tuple, '
                             f'got {type(prompt).__name__}')
        sources = [] if self.accepts_images else None
        if isinstance(prompt, tuple) and sources is None:
            raise ValueError('this model does not accept images')
        text = self.render(prompt, do_preprocess, sources, tools, template_kwargs)
        tokenized = self.image_inputs.expand_text(text) if sources else text
        # a chat template writes the special tokens (BOS) itself; text without one (contents joined) gets the tokenizer's
        templated = do_preprocess and bool(self.chat_template or getattr(self.tokenizer.hf, 'chat_template', None))
        input_ids = self.tokenizer.encode(tokenized, add_special_tokens=not templated)
        if not sources:
            return ProcessedPrompt(input_ids, text=text)
        if len(sources) > self.max_images:
            raise ValueError(f'a prompt may hold at most {self.max_images} images, got {len(sources)}')
        expanded = self._expand(input_ids, sources, stop, token_limit)
        expanded.text = text
        return expanded

    def _expand(self, input_ids: list[int], sources: list, stop: threading.Event | None,
                token_limit: int | None) -> ProcessedPrompt:
        """Loads and preprocesses each image, one at a time (only its features stay), and replaces its
        placeholder token by its span (the family's ``placeholder_ids``: most repeat the placeholder once per
        feature the vision encoder gives it), between the family's ``span_ids``; checks ``token_limit``
        against the prompt's least length before each image (see :meth:`process`)."""
        placeholder = self.image_inputs.image_token_id
        where = [i for i, token in enumerate(input_ids) if token == placeholder]
        if len(where) != len(sources):
            raise ValueError(f'the prompt has {len(where)} image placeholders for {len(sources)} images')
        before, after = self.image_inputs.span_ids
        sizes = [image_size(source) for source in sources] if token_limit is not None else [None] * len(sources)
        spans = [len(before) + self.image_inputs.least_tokens(size) + len(after) for size in sizes]
        expanded: list[int] = []
        multimodal = []
        start = 0
        for index, (position, source) in enumerate(zip(where, sources)):
            least = len(input_ids) - len(sources) + sum(spans)
            if token_limit is not None and least >= token_limit:
                raise PromptTooLong(least, token_limit)
            if stop is not None and stop.is_set():
                raise ValueError('the request was given up while its images were preprocessed')
            image = load_image(source, self.media_policy)
            length, data = self.image_inputs(image)
            expanded += input_ids[start:position] + before
            multimodal.append(MultiModalInput(len(expanded), length, image_hash(image), data))
            ids = self.image_inputs.placeholder_ids(length, data)
            expanded += ids + after
            spans[index] = len(before) + len(ids) + len(after)
            start = position + 1
        return ProcessedPrompt(expanded + input_ids[start:], multimodal)

    def encode(self, prompt: Prompt, do_preprocess: bool = True) -> list[int]:
        """Token ids of a prompt, image placeholders expanded; raises ``ValueError`` for bad input."""
        return self.process(prompt, do_preprocess).input_ids
