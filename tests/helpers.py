"""Helpers shared by the engine tests; ``LMDEPLOY_TEST_DEVICE=cuda`` runs the engines they make on CUDA."""
from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.cpu_fp32 import NativeFp32Kernel
from lmdeploy.pytorch.nn.quant.gguf import DequantizedKernel
from lmdeploy.pytorch.weights.file_checks import PlainArrayReader

GREEDY_32 = GenerationConfig(max_new_tokens=32, ignore_eos=True)


def large_step_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What a block-quantized layer's large step gives on its dequantized bf16 ``weight``: the native bf16 GEMM on
    its packed panels for bf16 ``x`` where large steps take it (AVX512-BF16 without AMX), else ``F.linear``."""
    native = cpu.native()
    if x.dtype == torch.bfloat16 and native is not None and native.dequantizing_gemm_available():
        return native.bf16_linear(x, native.pack_bf16_weight(weight), bias)
    return torch.nn.functional.linear(x, weight.to(x.dtype), bias)


def fp32_kernel(fallback: type = DequantizedKernel) -> type:
    """An fp32 CPU layer's kernel (a GGUF layer's once its blocks are dequantized at load): the fixed-order fp32
    GEMM's where it is built (AVX-512), else ``fallback``."""
    return NativeFp32Kernel if cpu.fp32_gemm() is not None else fallback


def dequantized_weight(kernel: DequantizedKernel | NativeFp32Kernel) -> torch.Tensor:
    """The fp32 weight ``[N, K]`` that ``fp32_kernel()`` holds."""
    if isinstance(kernel, DequantizedKernel):
        return kernel.weight
    return kernel.weight_rows(torch.arange(kernel.out_features))


def random_prompts(lengths, seed=0, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def scattered_block_table(lengths: list[int], block_size: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    """A block table giving each sequence distinct blocks in random order (drawn with ``g``) for its ``lengths``
    tokens, padded with block 0, and the number of blocks it draws from (three spare)."""
    widths = [-(-n // block_size) for n in lengths]
    num_blocks = sum(widths) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table, used = [], 0
    for w in widths:
        table.append(perm[used:used + w] + [0] * (max(widths) - w))
        used += w
    return torch.tensor(table), num_blocks


def make_engine(path, **kwargs) -> Engine:
    kwargs.setdefault('num_gpu_blocks', 128)
    kwargs.setdefault('block_size', 16)
    kwargs.setdefault('device', os.environ.get('LMDEPLOY_TEST_DEVICE', 'cpu'))
    if kwargs['device'].startswith('cuda'):
        kwargs.setdefault('max_batch_size', 16)  # fewer CUDA graphs to capture per engine
    return Engine(path, PytorchEngineConfig(dtype='float32', **kwargs), show_progress=False)


def add_requests(engine: Engine, prompts, gen_config=GREEDY_32) -> list[int]:
    """Queues ``prompts``: token lists, or processed prompts (``input_ids`` and ``multimodal``) with images."""
    return [engine.add_request(p.input_ids, gen_config, p.multimodal) if hasattr(p, 'input_ids') else
            engine.add_request(p, gen_config) for p in prompts]


def collect(engine: Engine, seq_ids: list[int]) -> list[list[int]]:
    """Steps ``engine`` until nothing is left to do; the tokens of each of ``seq_ids``, in that order."""
    index = {seq_id: i for i, seq_id in enumerate(seq_ids)}
    outs = [[] for _ in seq_ids]
    while engine.has_unfinished():
        for out in engine.step():
            outs[index[out.seq_id]].extend(out.token_ids)
    return outs


def run(engine: Engine, prompts, gen_config=GREEDY_32) -> list[list[int]]:
    return collect(engine, add_requests(engine, prompts, gen_config))


def load_gguf_reference(gguf_path: str):
    """transformers' own reading of a GGUF file, dequantized to fp32."""
    import functools

    import gguf
    from transformers import AutoModelForCausalLM
    with pytest.MonkeyPatch.context() as patch:
        # transformers builds gguf's (pure) name map anew for each of the model's modules (5 s of 14 for the default)
        patch.setattr(gguf, 'get_tensor_name_map', functools.cache(gguf.get_tensor_name_map))
        # and reads the file twice, config then weights (17 s each for Gemma 3's 262k-token vocabulary), each
        # time through an np.memmap (PlainArrayReader reads the same 4x faster)
        patch.setattr(gguf, 'GGUFReader', functools.cache(PlainArrayReader))
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                    dtype=torch.float32).eval()


def assert_same_state(converted, reference) -> None:
    """``converted``'s tensors are ``reference``'s, bit for bit, under the same names and no others."""
    state = reference.state_dict()
    assert converted.state_dict().keys() == state.keys()
    for name, value in converted.state_dict().items():
        torch.testing.assert_close(value, state[name], rtol=0, atol=0, msg=name)


def q8_0_blocks(param: torch.Tensor):
    """``param`` as llama.cpp's Q8_0 blocks (a numpy array); ``param`` set to the weights they hold."""
    import gguf
    blocks = gguf.quants.quantize(param.numpy(), gguf.GGMLQuantizationType.Q8_0)
    param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0)))
    return blocks


def hf_greedy(model, prompt, n=32) -> list[int]:
    model.generation_config.eos_token_id = None
    input_ids = torch.tensor([prompt])
    ids = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                         do_sample=False, top_k=None, top_p=None, temperature=None)
    return ids[0, len(prompt):].tolist()


def reference_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(tokens), V]`` at each step of a run of ``tokens`` after ``prompt``, fed those
    tokens, in one forward: row 0 is the last prompt position's (the first step's logits)."""
    with torch.no_grad():
        return model(torch.tensor([prompt + tokens[:-1]]), logits_to_keep=len(tokens)).logits[0]


def reference_argmax(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' argmax at each step of a greedy run of ``tokens`` after ``prompt``, fed those tokens: one
    forward, equal to ``tokens`` exactly when transformers' own greedy run gives them (``hf_greedy`` steps once
    a token, 10x the CPU time on the default model)."""
    return reference_logits(model, prompt, tokens).argmax(-1).tolist()


def assert_transformers_greedy(model, prompts, outs: list[list[int]], n: int = 32) -> None:
    """``outs`` are transformers' ``n`` greedy tokens after each of ``prompts``: checked with
    :func:`reference_argmax`, one forward a prompt (:func:`hf_greedy`'s ``n`` steps cost 5x the CPU time on a
    tiny model)."""
    assert len(outs) == len(prompts)
    for prompt, tokens in zip(prompts, outs):
        assert len(tokens) == n and reference_argmax(model, prompt, tokens) == tokens, (prompt, tokens)


def engine_state(engine) -> dict:
    """An ``AsyncEngine``'s engine state, read on its engine-loop thread after everything queued before."""
    def read(e):
        bm = e.block_manager
        return {'free': bm.num_free_blocks == bm.num_blocks, 'sequences': len(e.sequences),
                'unfinished': e.has_unfinished()}
    return engine.engine_loop.call(read).result(10)


def assert_all_released(engine) -> None:
    """Nothing of any request is held: KV blocks, sequences, sessions, engine instances."""
    assert engine_state(engine) == {'free': True, 'sequences': 0, 'unfinished': False}
    assert engine.session_manager.num_active == 0 and not engine.session_manager.sessions
    assert engine.inst_manager.num_busy == 0 and engine.inst_manager.num_waiting == 0


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_gone(pids: list[int], timeout: float = 10) -> None:
    """Every process of ``pids`` has exited within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        time.sleep(0.1)
    assert not alive, f'processes {alive} outlived their engine'
