"""Tokenizer wrapper, streaming detokenization and stop words, on small tokenizers built offline."""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from lmdeploy.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer

CORPUS = ['héllo 世界 🙂 hello world', 'The quick brown fox jumps over the lazy dog.',
          'naïve café déjà vu — 日本語のテキスト 🙂🙃 ok', 'hello hello world world 世界 世界'] * 5
# Characters of 1 to 4 UTF-8 bytes, several absent from the training corpus (byte fallback / byte pieces).
CHARS = list('abc xyz .,!\n') + list('éïàζж') + list('世界日本語テ漢字') + ['🙂', '🙃', '🚀', '👍🏽', '👨\u200d👩\u200d👧']


def _byte_level(path) -> str:
    """GPT-2 style byte-level BPE."""
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=['<|endoftext|>'],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token='<|endoftext|>').save_pretrained(path)
    return str(path)


def _sentencepiece(path) -> str:
    """Llama-style SentencePiece BPE: "▁" for spaces, byte fallback, leading space stripped on decode."""
    tok = RawTokenizer(models.BPE(unk_token='<unk>'))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement='▁', prepend_scheme='first')
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=150, special_tokens=['<unk>', '<s>', '</s>'],
                                                         limit_alphabet=30))
    data = json.loads(tok.to_str())
    data['model']['byte_fallback'] = True
    for b in range(256):
        data['model']['vocab'].setdefault(f'<0x{b:02X}>', len(data['model']['vocab']))
    tok = RawTokenizer.from_str(json.dumps(data))
    tok.decoder = decoders.Sequence([decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(' ', 1, 0)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token='<unk>', bos_token='<s>', eos_token='</s>')
    hf.save_pretrained(path)
    return str(path)


@pytest.fixture(scope='module', params=['byte_level', 'sentencepiece'])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    build = _byte_level if request.param == 'byte_level' else _sentencepiece
    return Tokenizer(build(tmp_path_factory.mktemp(request.param)))


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens)
    deltas = [detok.step([t]) for t in ids]
    deltas.append(detok.finish())
    return deltas


def test_encode_decode_roundtrip(tokenizer):
    text = 'héllo 世界 🙂 naïve 🚀 ζ'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert tokenizer.vocab_size == len(tokenizer.hf) and max(ids) < tokenizer.vocab_size


def test_eos_ids_from_tokenizer_and_configs(tmp_path):
    path = _byte_level(tmp_path)
    assert Tokenizer(path).eos_token_ids == {0}
    (tmp_path / 'config.json').write_text(json.dumps({'eos_token_id': 7}))
    (tmp_path / 'generation_config.json').write_text(json.dumps({'eos_token_id': [5, 6]}))
    assert Tokenizer(path).eos_token_ids == {0, 5, 6, 7}


def test_chat_template_and_plain_fallback(tmp_path):
    tok = Tokenizer(_byte_level(tmp_path))
    messages = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'hi'}]
    assert tok.apply_chat_template(messages) == 'Be brief.\nhi'
    tok.hf.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert tok.apply_chat_template(messages) == '<system>Be brief.\n<user>hi\n<assistant>'
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == '<system>Be brief.\n<user>hi\n'


def test_streaming_valid_text_never_emits_replacement_char(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        text = ''.join(rng.choice(CHARS) for _ in range(rng.randint(1, 30)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = _stream(tokenizer, ids)
        assert all('\ufffd' not in d for d in deltas), deltas
        assert ''.join(deltas) == tokenizer.decode(ids)


@pytest.mark.parametrize('skip_special_tokens', [True, False])
def test_streaming_random_ids_matches_full_decode(tokenizer, skip_special_tokens):
    """Arbitrary tokens (stray bytes, special tokens, lone spaces) mixed with encoded characters.

    SentencePiece byte-fallback tokens (``<0xNN>``) only come as whole characters: in an invalid byte run
    the fallback decoder replaces every byte, also ones that were already streamed.
    """
    vocab = tokenizer.hf.get_vocab()
    free = sorted(i for t, i in vocab.items() if not (t.startswith('<0x') and len(t) == 6))
    rng = random.Random(1)
    for _ in range(300):
        ids = []
        while len(ids) < rng.randint(1, 25):
            ids += [rng.choice(free)] if rng.random() < 0.6 else tokenizer.encode(rng.choice(CHARS), False)
        deltas = _stream(tokenizer, ids, skip_special_tokens)
        assert ''.join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_multibyte_char_is_held_until_complete(tokenizer):
    ids = tokenizer.encode('hello 🚀 ok', add_special_tokens=False)
    deltas = _stream(tokenizer, ids)
    rocket = next(i for i, d in enumerate(deltas) if '🚀' in d)
    assert deltas[:2] == ['hello', ' '] and deltas[rocket] == '🚀'
    assert rocket >= 4 and deltas[2:rocket] == [''] * (rocket - 2)  # held while the bytes were incomplete
    assert ''.join(deltas[rocket + 1:]) == ' ok'


def test_leading_spaces_kept_between_tokens(tokenizer):
    ids = tokenizer.encode('hello world hello', add_special_tokens=False)
    deltas = [d for d in _stream(tokenizer, ids) if d]
    assert ''.join(deltas) == 'hello world hello'
    assert any(d.startswith(' ') for d in deltas)


def test_finish_flushes_incomplete_tail(tokenizer):
    ids = tokenizer.encode('ok🚀', add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert ''.join(detok.step([t]) for t in ids) == 'ok'
    tail = detok.finish()
    assert tail and set(tail) == {'\ufffd'}
    assert 'ok' + tail == tokenizer.decode(ids)


def _feed_all(checker: StopChecker, deltas: list[str]) -> tuple[list[str], bool]:
    out = []
    for d in deltas:
        text, stopped = checker.feed(d)
        out.append(text)
        if stopped:
            return out, True
    out.append(checker.flush())
    return out, False


def test_stop_word_trims_text_and_is_never_streamed():
    out, stopped = _feed_all(StopChecker(['STOP']), ['Hello ', 'wor', 'ld S', 'TO', 'P and more'])
    assert stopped and ''.join(out) == 'Hello world '
    assert out == ['Hello ', 'wor', 'ld ', '', '']  # 'S', 'STO' held back, then dropped


def test_stop_word_prefix_released_when_it_diverges():
    out, stopped = _feed_all(StopChecker(['</end>']), ['a </', 'en', 'x> b'])
    assert not stopped and out == ['a ', '', '</enx> b', '']


def test_stop_word_inside_one_delta_and_earliest_wins():
    out, stopped = _feed_all(StopChecker(['bb', 'ab']), ['xxabbyy'])
    assert stopped and out == ['xx']


def test_an_included_stop_word_is_the_longest_of_those_found_first():
    out, stopped = _feed_all(StopChecker(['bb', 'ab', 'abb'], include_stop=True), ['xxa', 'bbyy'])
    assert stopped and out == ['xx', 'abb']


def test_held_back_text_flushed_at_end_and_no_stop_words_pass_through():
    out, stopped = _feed_all(StopChecker(['###']), ['answer #', '#'])
    assert not stopped and out == ['answer ', '', '##']
    checker = StopChecker(None)
    assert checker.feed('abc') == ('abc', False) and checker.flush() == ''


def test_stop_checker_on_random_streams():
    rng = random.Random(2)
    words = ['ab', 'cab', 'ca']
    for _ in range(500):
        text = ''.join(rng.choice('abc ') for _ in range(rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        deltas = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        out, stopped = _feed_all(StopChecker(words), deltas)
        first = min((i for i in (text.find(w) for w in words) if i >= 0), default=-1)
        assert stopped == (first >= 0)
        assert ''.join(out) == (text[:first] if stopped else text)
