"""Reasoning through ``pipeline()``: on a tiny random gpt-oss the harmony parser applies by itself, so a
reply's analysis channel comes back as ``Response.reasoning_content`` and its final channel as ``text``,
streamed (deltas adding up to the same) or not, and a chat session's history holds the answer as the
content and the reasoning as gpt-oss's template takes it (``thinking``); a model without a parser of its
own is unchanged, unless a parser is asked for ('qwen3' splits ``<think>`` blocks).

As in test_harmony_server.py, a grammar forces the random model's reply (logit_bias prefers harmony's
markers as special tokens to their spelling in characters), and the parsers' ``grammar_after`` is patched
to None so that the grammar covers the whole reply, not only the answer."""
from __future__ import annotations

import re

import pytest
from harmony_models import save_harmony_model
from tool_models import save_tool_model

from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
from lmdeploy.serve.openai.harmony import CALL, RETURN, SPECIAL_TOKENS
from lmdeploy.serve.openai.reasoning_parsers import get_reasoning_parser

WORDS = '[a-z ]{3,12}'
FINAL_REPLY = (rf'<\|channel\|>analysis<\|message\|>{WORDS}<\|end\|><\|start\|>assistant'
               rf'<\|channel\|>final<\|message\|>{WORDS}')
ASK = 'Weather in Paris?'


def make_pipe(path: str, **kwargs):
    config = PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16, session_len=512)
    return pipeline(path, backend_config=config, show_progress=False, **kwargs)


@pytest.fixture(scope='module')
def pipe(tmp_path_factory):
    path = save_harmony_model(str(tmp_path_factory.mktemp('harmony_model')))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(get_reasoning_parser('harmony'), 'grammar_after', lambda self: None)
        with make_pipe(path) as p:
            yield p


@pytest.fixture(scope='module')
def forced(pipe) -> GenerationConfig:
    """Greedy, constrained to :data:`FINAL_REPLY` and ending at ``<|return|>``."""
    tokenizer = pipe.tokenizer.hf
    bias = {tokenizer.convert_tokens_to_ids(m): 100.0 for m in SPECIAL_TOKENS if m != CALL}
    return GenerationConfig(max_new_tokens=200, response_format={'type': 'regex', 'regex': FINAL_REPLY},
                            logit_bias=bias)


def test_gpt_oss_gets_the_harmony_parser(pipe):
    assert pipe.reasoning_parser is get_reasoning_parser('harmony')


def test_reply_splits_into_reasoning_and_answer(pipe, forced):
    r = pipe(ASK, gen_config=forced)
    assert r.finish_reason == 'stop'
    assert re.fullmatch(WORDS, r.reasoning_content) and re.fullmatch(WORDS, r.text)
    raw = pipe.tokenizer.decode(r.token_ids, skip_special_tokens=False)
    assert raw == (f'<|channel|>analysis<|message|>{r.reasoning_content}<|end|><|start|>assistant'
                   f'<|channel|>final<|message|>{r.text}{RETURN}')
    batch = pipe([ASK, [{'role': 'user', 'content': ASK}]], gen_config=forced)
    assert [(b.reasoning_content, b.text) for b in batch] == [(r.reasoning_content, r.text)] * 2


def test_streamed_deltas_add_up_to_the_reply(pipe, forced):
    whole = pipe([ASK, 'Hello'], gen_config=forced)
    chunks = list(pipe.stream_infer([ASK, 'Hello'], gen_config=forced))
    for index, expected in enumerate(whole):
        mine = [c for c in chunks if c.index == index]
        assert all(isinstance(c.reasoning_content, str) for c in mine)
        assert ''.join(c.reasoning_content for c in mine) == expected.reasoning_content
        assert ''.join(c.text for c in mine) == expected.text
        first_answer = next(i for i, c in enumerate(mine) if c.text)
        assert not any(c.reasoning_content for c in mine[first_answer:])  # the reasoning came first
        assert len(mine) > 3 and mine[-1].finish_reason == 'stop'


def test_reasoning_tokens_count_the_analysis_channel(pipe, forced):
    """``Response.reasoning_tokens`` (was absent): the tokens of the analysis message, not the channel markers
    around it; in a stream, the last chunk's (None before)."""
    r = pipe(ASK, gen_config=forced)
    ids = pipe.tokenizer.hf.convert_tokens_to_ids(['<|message|>', '<|end|>'])
    analysis = r.token_ids.index(ids[1]) - r.token_ids.index(ids[0]) - 1
    assert analysis > 0 and r.reasoning_tokens == analysis
    chunks = list(pipe.stream_infer(ASK, gen_config=forced))
    assert [c.reasoning_tokens for c in chunks] == [None] * (len(chunks) - 1) + [analysis]


def test_chat_history_holds_the_answer_and_the_thinking(pipe, forced):
    session = pipe.session(gen_config=forced)
    pipe.chat(ASK, session=session)
    first = session.response
    assert first.reasoning_content and first.text
    assert session.history == [{'role': 'user', 'content': ASK},
                               {'role': 'assistant', 'content': first.text, 'thinking': first.reasoning_content}]
    pipe.chat('And in Rome?', session=session)  # the template refuses channel markers in a content
    second = session.response
    assert second.finish_reason == 'stop' and second.reasoning_content and second.text
    assert session.history[2:] == [{'role': 'user', 'content': 'And in Rome?'},
                                   {'role': 'assistant', 'content': second.text,
                                    'thinking': second.reasoning_content}]
    prompt = pipe.tokenizer.hf.apply_chat_template(session.history[:3], add_generation_prompt=True, tokenize=False)
    assert f'<|channel|>final<|message|>{first.text}<|end|>' in prompt and 'analysis' not in prompt
    pipe.end_session(session)


def test_unknown_parser_is_refused_before_loading():
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'; known: .*harmony"):
        make_pipe('/no/such/model', reasoning_parser='nope')


def test_a_model_without_a_parser_is_unchanged_unless_one_is_asked_for(tmp_path):
    """The tool model's template opens no think block; the prompt (template skipped) does, and a grammar
    forces the reply to close it: without a parser that is all text, with 'qwen3' it splits."""
    path = save_tool_model(str(tmp_path / 'think_model'))
    prompt = '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n'
    gen = GenerationConfig(max_new_tokens=60, response_format={'type': 'regex', 'regex': f'{WORDS}</think>{WORDS}'})
    with make_pipe(path) as plain:
        assert plain.reasoning_parser is None
        r = plain(prompt, gen_config=gen, do_preprocess=False)
        chunks = list(plain.stream_infer(prompt, gen_config=gen, do_preprocess=False))
        session = plain.chat('Hi', gen_config=GenerationConfig(max_new_tokens=4, ignore_eos=True))
    assert r.reasoning_content is None and r.reasoning_tokens is None and '</think>' in r.text
    assert all(c.reasoning_content is None for c in chunks) and ''.join(c.text for c in chunks) == r.text
    assert session.history[1] == {'role': 'assistant', 'content': session.response.text}
    with pytest.MonkeyPatch.context() as patch, make_pipe(path, reasoning_parser='qwen3') as think:
        patch.setattr(get_reasoning_parser('qwen3'), 'grammar_after', lambda self: None)
        split = think(prompt, gen_config=gen, do_preprocess=False)
    reasoning, answer = r.text.split('</think>')
    assert (split.reasoning_content, split.text) == (reasoning, answer.lstrip())
    assert split.token_ids == r.token_ids
    within = next(k for k in range(len(r.token_ids)) if len(plain.tokenizer.decode(r.token_ids[:k])) >= len(reasoning))
    assert split.reasoning_tokens == within  # the tokens that reach into the reasoning, not those of </think>
