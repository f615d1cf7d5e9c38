"""A converted Gemma 3 folder declares ``TokenizersBackend``, which reads its tokenizer.json in Rust alone, where the
``GemmaTokenizer`` that transformers would pick rebuilds the same pipeline in Python: on the real Gemma 3 270M
vocabulary both give the same vocabulary, token strings, special tokens, encodings, decodings and chat template
output (whitespace runs, emoji, scripts, the file's special tokens written out, random ids)."""
from __future__ import annotations

import random

import pytest
from transformers import GemmaTokenizer

from lmdeploy.model_source import gemma3_270m_path, resolve_model_path
from lmdeploy.tokenizer import Tokenizer

TEXTS = ['', ' ', '\n\n\n', '\t\t x', ' ' * 100, ' \t \n ' * 30, 'x' + ' ' * 257 + 'y', ' Hello  world ',
         'Привет, мир', 'مرحبا بالعالم', 'नमस्ते दुनिया', '你好，世界', 'こんにちは', '😀', '👨‍👩‍👧‍👦 🏳️‍🌈 🇯🇵',
         'emoji😀in😀words', '\u200b\u200d\ufeff', 'def f(x):\n    return x ** 2  # square\n', '{"a": [1, null]}',
         '1234567890 3.14159 -42', 'a' * 300, '<bos>x<eos>y<pad><mask><unk>', '< bos> <bos',
         '<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n', '<start_of_image><image_soft_token>',
         '\x00\x01\x7f \ufffd', 'İstanbul ǅ ﬁ ½ e\u0301']
# Gemma's turn markup, written here for the comparison (the GGUF file holds no chat template)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
            "m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope='module')
def tokenizers():
    folder = resolve_model_path(gemma3_270m_path())
    return Tokenizer(folder).hf, GemmaTokenizer.from_pretrained(folder)


def test_the_folder_loads_as_tokenizers_backend(tokenizers):
    declared, gemma = tokenizers
    assert type(declared).__name__ == 'TokenizersBackend' and type(gemma) is GemmaTokenizer
    assert declared.get_vocab() == gemma.get_vocab()
    ids = list(range(len(gemma)))
    assert declared.convert_ids_to_tokens(ids) == gemma.convert_ids_to_tokens(ids)
    assert ({i: t.__getstate__() for i, t in declared.added_tokens_decoder.items()}
            == {i: t.__getstate__() for i, t in gemma.added_tokens_decoder.items()})
    for name in ('all_special_ids', 'all_special_tokens', 'bos_token_id', 'eos_token_id', 'pad_token_id',
                 'unk_token_id', 'mask_token_id', 'padding_side', 'model_max_length'):
        assert getattr(declared, name) == getattr(gemma, name), name


def test_encodings_decodings_and_chat_template_match(tokenizers):
    declared, gemma = tokenizers
    rng = random.Random(0)
    specials = [t.content for t in gemma.added_tokens_decoder.values()][:200]
    codes = [*range(32, 127), *range(0xa0, 0x800), *range(0x4e00, 0x4e80), *range(0x1f600, 0x1f640)]
    alphabet = [chr(c) for c in codes] + [' ', '   ', '\n', '\t'] + specials
    texts = TEXTS + [''.join(rng.choice(alphabet) for _ in range(rng.randint(1, 60))) for _ in range(300)]
    for text in texts:
        for special in (True, False):
            ids = gemma.encode(text, add_special_tokens=special)
            assert declared.encode(text, add_special_tokens=special) == ids, text
            for skip in (True, False):
                assert (declared.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
                        == gemma.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)), text
    for _ in range(300):  # ids no text encodes to: lone bytes, special tokens anywhere
        ids = [rng.randrange(len(gemma) if rng.random() < 0.7 else 300) for _ in range(rng.randint(1, 30))]
        for skip in (True, False):
            assert declared.decode(ids, skip_special_tokens=skip) == gemma.decode(ids, skip_special_tokens=skip), ids
    for n in range(40):
        messages = [{'role': ('user', 'assistant')[i % 2], 'content': rng.choice(texts)} for i in range(1 + n % 4)]
        rendered = [t.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                          add_generation_prompt=True) for t in (declared, gemma)]
        assert rendered[0] == rendered[1]
        assert (declared.encode(rendered[0], add_special_tokens=False)
                == gemma.encode(rendered[1], add_special_tokens=False))
