"""The checks each model family's tests make on a tiny random model: greedy tokens and first-step logits
against transformers in fp32, batching, chunked prefill and prefix-cache hits equal to solo runs, and
tensor parallelism equal to one rank."""
from __future__ import annotations

import logging
import operator

import torch
from transformers import AutoModelForCausalLM

from helpers import add_requests, assert_transformers_greedy, make_engine, random_prompts, run

from lmdeploy.messages import PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine


def hf_causal_lm(path: str, **kwargs):
    """transformers' model of ``path`` in fp32, for evaluation."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def first_step_logits(engine: Engine, prompts) -> torch.Tensor:
    """The last-position logits ``[len(prompts), V]`` (fp32, on the CPU) of one prefill step of ``prompts``."""
    add_requests(engine, prompts)
    return engine.runner.forward(engine.scheduler.schedule()).float().cpu()


def assert_bf16_within_twice_transformers(path: str) -> None:
    """bf16 on the CPU: one prefill step's last logits of three prompts differ from transformers' in fp32 by at
    most twice what transformers' own bf16 model does."""
    engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16),
                    show_progress=False)
    prompts = random_prompts([7, 31, 90], seed=2)
    hf_model = hf_causal_lm(path)
    refs = [hf_last_logits(hf_model, p) for p in prompts]
    hf_bf16 = [hf_last_logits(hf_model.to(torch.bfloat16), p).float() for p in prompts]
    for ref, hf_row, row in zip(refs, hf_bf16, first_step_logits(engine, prompts)):
        assert (row - ref).abs().max() <= 2 * (hf_row - ref).abs().max()


def assert_first_logits_close(engine: Engine, prompts, refs: list[torch.Tensor], tol: float = 1e-3,
                              relative: bool = False) -> None:
    """The first step's logits differ from ``refs`` by less than ``tol`` (times each ref's largest magnitude
    where ``relative``)."""
    logits = first_step_logits(engine, prompts)
    for row, ref in enumerate(refs):
        bound = tol * ref.abs().max().item() if relative else tol
        assert (logits[row] - ref).abs().max().item() < bound


def assert_vl_matches_transformers(path: str, hf_model, prompts, inputs: list[dict]) -> list[list[int]]:
    """A vision-language model's 32 greedy tokens of ``prompts`` in one batch equal transformers' ``generate`` on
    ``inputs`` (its inputs of each prompt), and the first step's logits are within 1e-3; returns the tokens."""
    outs = run(make_engine(path), prompts)
    for prompt, out, hf_input in zip(prompts, outs, inputs):
        expected = hf_model.generate(**hf_input, max_new_tokens=32, do_sample=False, top_k=None, top_p=None,
                                     temperature=None)
        assert out == expected[0, len(prompt.input_ids):].tolist()
    with torch.no_grad():
        refs = [hf_model(**hf_input).logits[0, -1] for hf_input in inputs]
    assert_first_logits_close(make_engine(path), prompts, refs)
    return outs


def hf_last_logits(hf_model, prompt: list[int]) -> torch.Tensor:
    """transformers' logits at the last position of ``prompt``."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0, -1]


def assert_matches_transformers(path: str, hf_model, greedy_prompts: list[list[int]],
                                logits_prompts: list[list[int]]) -> None:
    """32 greedy tokens of each of ``greedy_prompts`` (in one batch), and the first-step logits of
    ``logits_prompts`` within 1e-3, equal transformers'."""
    assert_transformers_greedy(hf_model, greedy_prompts, run(make_engine(path), greedy_prompts))
    assert_first_logits_close(make_engine(path), logits_prompts, [hf_last_logits(hf_model, p) for p in logits_prompts])


def prefix_sharing_prompts(lengths: tuple[int, int] = (100, 130), prefix: int = 64,
                           tails: tuple[int, int] = (20, 30)) -> list[list[int]]:
    """Two random prompts of ``lengths``, then two that share the first's ``prefix`` tokens."""
    prompts = random_prompts(lengths, seed=3)
    return prompts + [prompts[0][:prefix] + p for p in random_prompts(tails, seed=4)]


def assert_batched_chunked_and_cached_equal_solo(path: str, prompts, chunked: dict | None = None,
                                                 cached: dict | None = None, warm: slice = slice(1)) -> None:
    """``prompts`` give the same tokens batched as one by one, in prefill chunks (engine options ``chunked``,
    by default chunks of 16 tokens), and on an engine (options ``cached``) that cached ``prompts[warm]`` first
    and hits that cache."""
    plain = run(make_engine(path, enable_prefix_caching=False), prompts)
    assert [run(make_engine(path, enable_prefix_caching=False), [p])[0] for p in prompts] == plain
    assert run(make_engine(path, **(chunked or {'max_prefill_token_num': 16})), prompts) == plain
    engine = make_engine(path, **(cached or {}))
    run(engine, prompts[warm])
    assert run(engine, prompts) == plain
    assert engine.block_manager.num_hits > 0


def assert_tp2_equals_tp1(path: str, prompts: list[list[int]], logits: bool = False) -> None:
    """Two ranks (gloo on the CPU) give one rank's greedy tokens (and with ``logits`` the last prompt's logits at
    every position within 1e-4)."""
    reference = make_engine(path)
    expected = run(reference, prompts)
    expected_logits = reference.get_logits(prompts[-1]) if logits else None
    engine = make_engine(path, tp=2)
    try:
        assert run(engine, prompts) == expected
        if logits:
            torch.testing.assert_close(engine.get_logits(prompts[-1]), expected_logits, rtol=1e-4, atol=1e-4)
    finally:
        engine.close()


def assert_native_stack_gives_the_layers_tokens(path: str) -> None:
    """bf16 on the native GEMMs (the ``native_gemms`` fixture): the model runs in the native decoder stack, with the
    tokens of its layers' own forward."""
    engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=64, block_size=16), show_progress=False)
    model = engine.runner.model
    assert model.native_stack is not None
    prompts = random_prompts([40, 9, 23], seed=6)
    outs = run(engine, prompts)
    model.native_stack = None
    assert run(engine, prompts) == outs


def assert_correction_bias_loaded_and_routing(path: str, hf_bias: str) -> None:
    """The MoE layers' (all but the dense first) router correction biases equal the checkpoint's (``hf_bias``, an
    attribute path in a transformers layer) and change the tokens: zeroed, the tokens differ."""
    engine = make_engine(path)
    hf_layers = hf_causal_lm(path).model.layers
    for layer, hf_layer in list(zip(engine.runner.model.layers, hf_layers))[1:]:
        assert layer.mlp.gate.e_score_correction_bias.equal(operator.attrgetter(hf_bias)(hf_layer))
    prompts = random_prompts([20, 45], seed=5)
    outs = run(engine, prompts)
    for layer in engine.runner.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert run(engine, prompts) != outs


def assert_batched_equals_solo_and_frees(engine: Engine, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """A recurrent model's engine: two prompts (6 and 41 tokens) batched give what each gives alone, and afterwards
    every KV block and state slot is free; the prompts and their batched outputs."""
    prompts = random_prompts([6, 41], seed=3, vocab=vocab)
    batched = run(engine, prompts)
    assert batched == [run(engine, [prompt])[0] for prompt in prompts]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.scheduler.state_pool.num_free == engine.scheduler.state_pool.num_slots
    return prompts, batched


def assert_slots_free(engine: Engine) -> None:
    """A recurrent model's engine holds no sequence, and every state slot and KV block is free."""
    pool = engine.scheduler.state_pool
    assert pool.num_free == pool.num_slots and not engine.sequences
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def assert_prefix_caching_off_and_every_logit_matches(path: str, caplog, prompt: list[int] | None = None) -> Engine:
    """A recurrent model's engine asked for prefix caching (prefill chunks of 16, one sequence at a time): it is
    off and says why, and every position's logits of ``prompt`` (50 random tokens by default) are within 1e-3 of
    transformers' (the states carried over between chunks). Returns the engine, its slots freed."""
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        engine = make_engine(path, enable_prefix_caching=True, max_prefill_token_num=16, max_batch_size=1)
    assert not engine.block_manager.enable_prefix_caching
    assert 'prefix caching is off' in caplog.text
    prompt = prompt or random_prompts([50], seed=7)[0]
    with torch.no_grad():
        expected = hf_causal_lm(path)(torch.tensor([prompt])).logits[0]
    assert (engine.get_logits(prompt) - expected).abs().max().item() < 1e-3
    assert_slots_free(engine)
    return engine
