"""lmdeploy's own endpoints: ``/generate``, ``/v1/encode`` and ``/abort_request``."""
from __future__ import annotations

from collections.abc import Iterable

from fastapi import Request
from starlette.types import Receive

from lmdeploy.messages import Response
from lmdeploy.serve.openai.errors import APIError
from lmdeploy.serve.openai.limits import check_fanout, check_messages, check_prompt_chars, check_stop
from lmdeploy.serve.openai.protocol import AbortRequest, EncodeRequest, GenerateRequest
from lmdeploy.serve.openai.request_start import admit_while_connected, admitted
from lmdeploy.serve.openai.serving_common import (Job, ServerState, check_model, check_prompt_ids, check_session,
                                                  check_token_ids, encode, gen_config, run_blocking)
from lmdeploy.serve.openai.streaming import collect_or_abort, sse, sse_stream


def _body(r: Response, session_id: int | None) -> dict:
    return {'text': r.text, 'token_ids': r.token_ids, 'logprobs': r.logprobs and [
        {str(k): v for k, v in entry.items()} for entry in r.logprobs], 'input_tokens': r.input_token_len,
        'generate_tokens': r.generate_token_len, 'cached_tokens': r.cached_tokens,
        'finish_reason': r.finish_reason, 'session_id': session_id}


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
        input_ids = req.input_ids
        if input_ids is None:
            input_ids = await request.unless_gone(encode(state, req.prompt, req.do_preprocess, 'prompt'))
            if input_ids is None:
                return None
        config = gen_config(state, req, len(input_ids), req.logprobs, None, model_defaults=False)
        run = request.start([Job(0, input_ids, config, request.reservations[0])])
    if req.stream:
        def render(r: Response) -> Iterable[str]:
            yield sse(_body(r, req.session_id))

        return sse_stream(run, render, list)
    responses = await collect_or_abort(raw, run)
    if responses is None:
        return None
    return _body(responses[0], req.session_id)


async def encode_text(state: ServerState, req: EncodeRequest, receive: Receive) -> dict:
    """Token ids of one text or of each of a list (chat-templated when ``do_preprocess``). The texts count
    against ``--max-fanout`` and ``--max-prompt-chars``, and tokenizing takes one admission slot; a request whose
    client (``receive``) goes away while it waits for that slot leaves the line (its answer is empty)."""
    texts = [req.input] if isinstance(req.input, str) else req.input
    check_fanout(state.limits, 1, len(texts), 'input')
    check_prompt_chars(state.limits, sum(len(t) for t in texts), 'input')
    ticket = await admit_while_connected(state, 1, receive)
    if ticket is None:
        return {}
    try:
        ids = []
        for text in texts:
            if req.do_preprocess:
                ids.append(await encode(state, text, True, 'input'))
            else:
                ids.append(await run_blocking(state, state.engine.tokenizer.encode, text, req.add_bos))
    finally:
        ticket.release()
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
