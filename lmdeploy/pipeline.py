"""``Pipeline``: the synchronous Python API over the engine."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Union

from tqdm import tqdm

from lmdeploy.messages import EngineOutput, GenerationConfig, PytorchEngineConfig, Response
from lmdeploy.pytorch.engine.engine import Engine

Messages = list[dict]
Prompt = Union[str, Messages]
Prompts = Union[Prompt, list[Prompt]]


def _as_batch(prompts: Prompts) -> tuple[list[Prompt], bool]:
    """Normalizes to a list of prompts; the flag says whether a single prompt was given."""
    if isinstance(prompts, str):
        return [prompts], True
    if isinstance(prompts, list) and prompts and all(isinstance(p, dict) for p in prompts):
        return [prompts], True
    if isinstance(prompts, list) and all(isinstance(p, (str, list)) for p in prompts):
        return list(prompts), False
    raise TypeError('prompts must be a str, an OpenAI-style message list, or a list of those')


class Pipeline:
    """Generates text for prompts with a local model (see :func:`lmdeploy.pipeline`)."""

    def __init__(self, model_path: str | None = None, backend_config: PytorchEngineConfig | None = None,
                 show_progress: bool = True):
        self.engine = Engine(model_path, backend_config, show_progress=show_progress)
        self.tokenizer = self.engine.tokenizer

    def encode(self, prompt: Prompt, do_preprocess: bool = True) -> list[int]:
        """Token ids of a prompt; ``do_preprocess`` applies the model's chat template to a str."""
        if isinstance(prompt, str) and not do_preprocess:
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        messages = [{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else prompt
        return self.tokenizer.encode(self.tokenizer.apply_chat_template(messages), add_special_tokens=False)

    def _submit(self, prompts: Prompts, gen_config, do_preprocess: bool) -> tuple[dict[int, int], list[int], bool]:
        batch, single = _as_batch(prompts)
        configs = gen_config if isinstance(gen_config, list) else [gen_config] * len(batch)
        if len(configs) != len(batch):
            raise ValueError(f'got {len(configs)} gen_configs for {len(batch)} prompts')
        encoded = [self.encode(p, do_preprocess) for p in batch]
        index_of: dict[int, int] = {}
        try:
            for index, (ids, config) in enumerate(zip(encoded, configs)):
                index_of[self.engine.add_request(ids, config or GenerationConfig())] = index
        except Exception:
            for seq_id in index_of:
                self.engine.abort(seq_id)
            raise
        return index_of, [len(ids) for ids in encoded], single

    def _run(self, index_of: dict[int, int]) -> Iterator[EngineOutput]:
        try:
            while self.engine.has_unfinished():
                yield from self.engine.step()
        finally:
            for seq_id in index_of:
                self.engine.abort(seq_id)

    def __call__(self, prompts: Prompts, gen_config: GenerationConfig | list[GenerationConfig] | None = None,
                 do_preprocess: bool = True, use_tqdm: bool = False) -> Response | list[Response]:
        """Generates a full response for each prompt (a single prompt gives a single Response)."""
        index_of, input_lens, single = self._submit(prompts, gen_config, do_preprocess)
        responses = [Response('', 0, n, index=i) for i, n in enumerate(input_lens)]
        progress = tqdm(total=len(responses), disable=not use_tqdm, desc='Generating')
        for out in self._run(index_of):
            r = responses[index_of[out.seq_id]]
            r.text += out.text
            r.token_ids.extend(out.token_ids)
            r.generate_token_len = out.num_output_tokens
            r.cached_tokens = out.num_cached_tokens
            if out.logprobs is not None:
                r.logprobs = (r.logprobs or []) + out.logprobs
            if out.finish_reason is not None:
                r.finish_reason = out.finish_reason
                progress.update(1)
        progress.close()
        return responses[0] if single else responses

    infer = __call__

    def stream_infer(self, prompts: Prompts, gen_config: GenerationConfig | list[GenerationConfig] | None = None,
                     do_preprocess: bool = True) -> Iterator[Response]:
        """Yields incremental ``Response`` chunks; ``chunk.index`` says which prompt each belongs to."""
        index_of, input_lens, _ = self._submit(prompts, gen_config, do_preprocess)
        for out in self._run(index_of):
            index = index_of[out.seq_id]
            yield Response(out.text, out.num_output_tokens, input_lens[index], out.finish_reason,
                           out.token_ids, out.logprobs, index, out.num_cached_tokens)

    def close(self) -> None:
        """Releases the engine."""
        self.engine = None

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
