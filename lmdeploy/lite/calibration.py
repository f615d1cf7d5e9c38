"""What the ``lmdeploy lite`` tools share: reading the source model and the calibration text, folding
per-input-channel factors into the layer that produces a projection's input, and writing the quantized copy.

A linear layer's input ``X`` and weight ``W`` give the same product as ``X / s`` and ``W * s`` (``s`` per
input channel). The division is folded into what produces ``X``: the RMSNorm weights before q/k/v and
gate/up (:func:`fold_norm`), v_proj's rows before o_proj and up_proj's rows before down_proj
(:func:`fold_pair`). The folded model computes what the original does, exactly in real numbers.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lmdeploy.lite import calibration_text
from lmdeploy.messages import ConfigError

SUPPORTED_ARCHITECTURES = ('LlamaForCausalLM', 'Qwen2ForCausalLM', 'Qwen3ForCausalLM')
PROJECTIONS = ('self_attn.q_proj', 'self_attn.k_proj', 'self_attn.v_proj', 'self_attn.o_proj', 'mlp.gate_proj',
               'mlp.up_proj', 'mlp.down_proj')


def is_projection(name: str) -> bool:
    """Whether ``name`` (a state dict key) is the weight of a decoder projection."""
    return name.endswith('.weight') and name.removesuffix('.weight').endswith(PROJECTIONS)


def check_arguments(out_dir: str, **counts: int) -> None:
    """Raises :class:`ConfigError` before any slow work when ``out_dir`` exists but is not a folder, or one
    of ``counts`` (by name) is below 1."""
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ConfigError(f'{out_dir} exists and is not a folder')
    for name, value in counts.items():
        if value < 1:
            raise ConfigError(f'{name} must be at least 1, got {value}')


def load_source(model_path: str, tool: str) -> tuple[Path, dict]:
    """The Hugging Face folder of ``model_path`` (a folder, or a .gguf file converted with every tensor
    dequantized, none kept as llama.cpp's blocks) and its ``config.json``; raises :class:`ConfigError` for
    architectures ``tool`` does not support and quantized models."""
    from lmdeploy.model_source import resolve_model_path
    from lmdeploy.pytorch.weights.gguf import resolve_gguf

    gguf_file = model_path is not None and Path(model_path).suffix == '.gguf'
    source = Path(resolve_gguf(str(Path(model_path).expanduser()), raw_types=()) if gguf_file else
                  resolve_model_path(model_path))
    config = json.loads((source / 'config.json').read_text())
    architecture = (config.get('architectures') or [None])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(f'{tool} supports {SUPPORTED_ARCHITECTURES}, not {architecture}')
    if config.get('quantization_config'):
        raise ConfigError(f'{model_path} is already quantized ({config["quantization_config"].get("quant_method")})')
    return source, config


def calibration_ids(source: Path, tokens: int) -> torch.Tensor:
    """The first ``tokens`` token ids (1-D) of the shipped calibration text, by ``source``'s tokenizer."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(source)(calibration_text())['input_ids'][:tokens]
    if len(ids) < tokens:
        raise ConfigError(f'the calibration text has {len(ids)} tokens for this tokenizer, fewer than {tokens}')
    return torch.tensor(ids)


def load_float_model(source: Path) -> torch.nn.Module:
    """``source`` as a transformers causal LM in fp32, for calibration."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()


def load_float_state(source: Path) -> dict[str, torch.Tensor]:
    """Every tensor of ``source``'s safetensors files, the floating-point ones in fp32."""
    from lmdeploy.pytorch.weights.safetensors_loader import safetensors_files

    state = {}
    for path in safetensors_files(str(source)):
        state.update({name: t.float() if t.is_floating_point() else t for name, t in load_file(path).items()})
    return state


def kv_shared(columns: torch.Tensor, group: int, head_dim: int, reduce: str) -> torch.Tensor:
    """Per-input-channel values of o_proj (``[heads * head_dim]``) reduced (``amax`` or ``mean``) over the
    ``group`` query heads that read each KV head: ``[kv_heads * head_dim]``."""
    view = columns.view(-1, group, head_dim)
    return (view.amax(1) if reduce == 'amax' else view.mean(1)).reshape(-1)


def fold_norm(state: dict[str, torch.Tensor], norm: str, projections: list[str], s: torch.Tensor) -> None:
    """Divides the RMSNorm ``norm``'s weight by ``s`` and multiplies the input columns of ``projections``."""
    state[f'{norm}.weight'] = state[f'{norm}.weight'] / s
    for name in projections:
        state[f'{name}.weight'] = state[f'{name}.weight'] * s


def fold_pair(state: dict[str, torch.Tensor], first: str, second: str, s: torch.Tensor, group: int,
              head_dim: int) -> None:
    """Divides ``first``'s output rows (and bias) by ``s`` and multiplies ``second``'s input columns. Input
    channel ``(h, d)`` of ``second`` reads row ``(h // group, d)`` of ``first`` (grouped-query attention,
    v_proj -> o_proj: ``s`` is per KV-head channel, shared by the ``group`` query heads that read it)."""
    state[f'{first}.weight'] = state[f'{first}.weight'] / s[:, None]
    if f'{first}.bias' in state:
        state[f'{first}.bias'] = state[f'{first}.bias'] / s
    state[f'{second}.weight'] = state[f'{second}.weight'] * expand_kv(s, group, head_dim)


def expand_kv(s: torch.Tensor, group: int, head_dim: int) -> torch.Tensor:
    """Per-KV-head-channel ``s`` (``[kv_heads * head_dim]``) repeated for the ``group`` query heads that
    read each KV head: per input channel of o_proj (``[heads * head_dim]``)."""
    return s.view(-1, 1, head_dim).expand(-1, group, -1).reshape(-1)


def attention_shape(config: dict) -> tuple[int, int]:
    """``(group, head_dim)``: query heads per KV head, and the head size."""
    heads = config['num_attention_heads']
    kv_heads = config.get('num_key_value_heads') or heads
    return heads // kv_heads, config.get('head_dim') or config['hidden_size'] // heads


def write_checkpoint(source: Path, out_dir: str, state: dict[str, torch.Tensor], config: dict,
                     quantization_config: dict) -> None:
    """``state`` as ``out_dir/model.safetensors`` with ``source``'s other files (tokenizer, generation
    config) and its ``config.json`` carrying ``quantization_config``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != '.safetensors' and not path.name.endswith('.safetensors.index.json'):
            shutil.copy2(path, out / path.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / 'model.safetensors'), metadata={'format': 'pt'})
    config = dict(config, quantization_config=quantization_config)
    config.pop('gguf_weight_type', None)  # the weights are no longer the GGUF file's grid
    (out / 'config.json').write_text(json.dumps(config, indent=2) + '\n')
