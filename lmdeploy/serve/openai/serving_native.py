"""lmdeploy's own endpoints: ``/generate``, ``/v1/encode`` and ``/abort_request``."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from fastapi import Request
from starlette.types import Receive

from lmdeploy.messages import GenerationConfig, Response
from lmdeploy.serve.openai.errors import APIError
from lmdeploy.serve.openai.limits import check_fanout, check_messages, check_prompt_chars, check_stop
from lmdeploy.serve.openai.protocol import AbortRequest, EncodeRequest, GenerateRequest
from lmdeploy.serve.openai.request_start import admit, admitted, while_connected
from lmdeploy.serve.openai.serving_common import (Job, ServerState, check_model, check_prompt_ids, check_session,
                                                  check_token_ids, encode, gen_config, process, run_blocking)
from lmdeploy.serve.openai.streaming import collect_or_abort, sse, sse_stream
from lmdeploy.serve.reasoning import ReasoningCounter, keep_special_tokens
from lmdeploy.tokenizer import IncrementalDetokenizer

ReasoningCount = Callable[[Response], int | None]


def _body(r: Response, session_id: int | None, reasoning_tokens: int | None) -> dict:
    return {'text': r.text, 'token_ids': r.token_ids, 'logprobs': r.logprobs and [
        {str(k): v for k, v in entry.items()} for entry in r.logprobs], 'input_tokens': r.input_token_len,
        'generate_tokens': r.generate_token_len, 'cached_tokens': r.cached_tokens,
        'reasoning_tokens': reasoning_tokens, 'finish_reason': r.finish_reason, 'session_id': session_id}


def _reasoning_count(state: ServerState, input_ids: list[int], config: GenerationConfig) -> ReasoningCount:
    """Takes a reply's chunks in order and gives its reasoning tokens at the last (None before, and always without
    a reasoning parser). The text stays whole, so the parser reads the tokens' text itself, with its markers
    kept where ``config`` would leave them out."""
    if state.reasoning_parser is None:
        return lambda _: None
    tokenizer = state.engine.tokenizer
    parser = state.reasoning_parser(tokenizer.decode(input_ids, skip_special_tokens=False))
    config = keep_special_tokens(config, parser.markers)
    counter = ReasoningCounter(IncrementalDetokenizer(tokenizer, [], config.skip_special_tokens,
                                                      config.keep_special_tokens))

    def count(r: Response) -> int | None:
        parser.feed(counter.add(r.token_ids))
        if r.finish_reason is None:
            return None
        parser.finish()
        return counter.count(parser)
    return count


async def generate(state: ServerState, req: GenerateRequest, raw: Request):
    """Generates from ``prompt`` or ``input_ids``; streams ``{text, token_ids, ...}`` deltas when ``stream``."""
    check_model(state, req.model)
    if (req.prompt is None) == (req.input_ids is None):
        raise APIError(400, 'give exactly one of prompt and input_ids', 'prompt')
    if req.n != 1:
        raise APIError(400, '/generate serves one sample per request; use /v1/completions for n > 1', 'n')
    check_session(state, req.session_id, 1)
    check_stop(state.limits, req.stop, req.stop_token_ids)
    if req.input_ids is not None:
        check_token_ids(state, req.input_ids, 'input_ids', 'input_ids')
        check_prompt_ids(state, req.input_ids, 'input_ids')
    elif isinstance(req.prompt, str):
        check_prompt_chars(state.limits, len(req.prompt))
    else:
        check_messages(state.limits, req.prompt, 'prompt')
    async with admitted(state, 1, req.session_id, raw.receive) as request:
        input_ids, multimodal = req.input_ids, []
        if input_ids is None:
            prompt = await request.unless_gone(process(state, req.prompt, 'prompt', do_preprocess=req.do_preprocess))
            if prompt is None:
                return None
            input_ids, multimodal = prompt.input_ids, prompt.multimodal
        config = gen_config(state, req, len(input_ids), req.logprobs, None, model_defaults=False)
        reasoning = await run_blocking(state, _reasoning_count, state, input_ids, config)
        run = request.start([Job(0, input_ids, config, request.reservations[0], multimodal)])
    if req.stream:
        def render(r: Response) -> Iterable[str]:
            yield sse(_body(r, req.session_id, reasoning(r)))

        return sse_stream(run, render)
    responses = await collect_or_abort(raw, run)
    if responses is None:
        return None
    return _body(responses[0], req.session_id, await run_blocking(state, reasoning, responses[0]))


async def encode_text(state: ServerState, req: EncodeRequest, receive: Receive) -> dict:
    """Token ids of one text or of each of a list (chat-templated when ``do_preprocess``). The texts count
    against ``--max-fanout`` and ``--max-prompt-chars``, and tokenizing takes one admission slot; a request whose
    client (``receive``) goes away while it waits for that slot, or is tokenized, gives the slot back at once
    (its answer is empty)."""
    texts = [req.input] if isinstance(req.input, str) else req.input
    check_fanout(state.limits, 1, len(texts), 'input')
    check_prompt_chars(state.limits, sum(len(t) for t in texts), 'input')

    async def tokenize() -> list[list[int]]:
        ticket = await admit(state, 1)
        try:
            if req.do_preprocess:
                return [await encode(state, text, True, 'input') for text in texts]
            return [await run_blocking(state, state.engine.tokenizer.encode, text, req.add_bos) for text in texts]
        finally:
            ticket.release()

    ids = await while_connected(tokenize(), receive)
    if ids is None:
        return {}
    if isinstance(req.input, str):
        return {'input_ids': ids[0], 'length': len(ids[0])}
    return {'input_ids': ids, 'length': [len(i) for i in ids]}


async def abort_request(state: ServerState, req: AbortRequest) -> dict:
    """Aborts one session's request, or every request with ``abort_all``; returns once the engine let go."""
    if req.abort_all:
        await state.engine.stop_all_session()
    elif req.session_id is not None:
        await state.engine.abort_session(req.session_id)
    else:
        raise APIError(400, 'give session_id or abort_all: true', 'session_id')
    return {'success': True}
