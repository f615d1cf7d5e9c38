"""AWQ 4-bit checkpoints (Lin et al., 2024, "AWQ: Activation-aware Weight Quantization"), written in AutoAWQ's
GEMM layout, which the engine (``nn/quant/awq.py``) and transformers' ``AwqConfig`` read.

Per group of projections that read the same input ``X`` (q/k/v, gate/up, o_proj, down_proj) the search
tries ``s = mean|X|^alpha`` per input channel for ``alpha`` on a grid over [0, 1], quantizes ``W * s``,
and keeps the ``s`` whose block (attention, MLP, or the projection itself) gives the output closest to the
unquantized one on the calibration activations (mean squared error); ``alpha = 0`` is plain round to
nearest, so the search never does worse than it on the calibration data. The error comes from the weight
change ``D = Q(W * s) / s - W`` alone: the projections' unquantized outputs, recorded once, plus ``X @ D.T``
(bf16 products summed in fp32) through the attention's softmax or the MLP's activation, and o_proj's or
down_proj's product with the change of its input, so no unquantized projection runs again. Salient input
channels (large activations) get finer steps in ``W * s``; ``X / s`` is folded into the layer before
(:mod:`lmdeploy.lite.calibration`). Then the clipping search (:func:`clip_weight`) narrows the range of
each group of each projection but q and k where that brings the group's part of the output closer on
``X / s``. Every layer's inputs come from the unquantized model, as AutoAWQ does.
Then each weight is quantized asymmetrically in groups of ``group_size`` inputs:
``W = (q - zero) * scale`` with 4-bit ``q`` and ``zero``, fp16 ``scale``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from lmdeploy.lite.calibration import (attention_shape, calibration_ids, check_arguments, expand_kv, fold_norm,
                                       fold_pair, is_projection, kv_shared, load_float_model, load_float_state,
                                       load_source, write_checkpoint)
from lmdeploy.messages import ConfigError
from lmdeploy.pytorch.nn.quant.awq import AWQ_FIELD

MIN_SCALE = 1e-4
CLIP_TOKENS = 1024  # calibration tokens (evenly spaced) the clipping search weighs the output error on
CLIP_CHUNK = 1 << 22  # weights per chunk of output channels in the clipping search
# the projections clipped (all but q and k, whose errors reach the output through the softmax, as AutoAWQ
# leaves them), each with the projection whose recorded input it reads and the key of the factors it is divided by
CLIPPED = {'self_attn.v_proj': ('self_attn.q_proj', 'input_layernorm'),
           'self_attn.o_proj': ('self_attn.o_proj', 'self_attn.v_proj'),
           'mlp.gate_proj': ('mlp.gate_proj', 'post_attention_layernorm'),
           'mlp.up_proj': ('mlp.gate_proj', 'post_attention_layernorm'),
           'mlp.down_proj': ('mlp.down_proj', 'mlp.up_proj')}


def _steps(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` as ``[N, K / G, G]`` in fp32, and per group its step (an fp16 value, in fp32) and zero
    point (integer-valued fp32), ``[N, K / G, 1]`` each."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f'{in_features} inputs do not split into groups of {group_size} (--w-group-size)')
    grouped = weight.float().reshape(out_features, -1, group_size)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    step = ((high - low).clamp_min(1e-5) / 15).half().float()
    return grouped, step, (-(low / step).round()).clamp(0, 15)


def quantize_groups(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit round to nearest of ``weight [N, K]`` in groups of ``group_size`` inputs: codes
    ``[N, K]`` and zero points ``[N, K / G]`` (int32 in 0-15), fp16 scales ``[N, K / G]``."""
    grouped, step, zeros = _steps(weight, group_size)
    codes = ((grouped / step).round() + zeros).clamp(0, 15)
    return codes.reshape(weight.shape).to(torch.int32), zeros[..., 0].to(torch.int32), step[..., 0].half()


def fake_quantize(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``weight`` as its 4-bit grid (:func:`quantize_groups`) reads back, in fp32: ``(q - zero) * scale``,
    which is ``clamp(round(w / scale), -zero, 15 - zero) * scale`` (small integers, exact in fp32)."""
    grouped, step, zeros = _steps(weight, group_size)
    return (grouped / step).round_().clamp_(-zeros, 15 - zeros).mul_(step).reshape(weight.shape)


def pack_awq(codes: torch.Tensor) -> torch.Tensor:
    """``[rows, N]`` 4-bit codes as AWQ's ``[rows, N / 8]`` int32: output ``j`` of each eight in field
    ``AWQ_FIELD[j]`` (bits ``4 * AWQ_FIELD[j]``)."""
    fields = torch.zeros(codes.shape[0], codes.shape[1] // 8, 8, dtype=torch.int64)
    fields[..., AWQ_FIELD] = codes.long().view(codes.shape[0], -1, 8)
    packed = (fields << (4 * torch.arange(8))).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def awq_tensors(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """``qweight``, ``qzeros`` and ``scales`` of ``weight [N, K]`` in AutoAWQ's GEMM layout."""
    codes, zeros, scales = quantize_groups(weight, group_size)
    return {'qweight': pack_awq(codes.T), 'qzeros': pack_awq(zeros.T), 'scales': scales.T.contiguous()}


def _output_error(delta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per row of ``delta [N, K]`` (a weight error), the mean squared output error it makes on ``x [T, K]``."""
    return (x @ delta.T).pow(2).mean(0)


@torch.no_grad()
def clip_weight(weight: torch.Tensor, x: torch.Tensor, group_size: int, n_grid: int = 20, max_shrink: float = 0.5,
                max_tokens: int = CLIP_TOKENS) -> torch.Tensor:
    """AWQ's weight clipping: ``weight [N, K]`` with each group of ``group_size`` inputs of each output clamped to
    ``[-r * max|w|, r * max|w|]`` for the ``r`` in ``1, 1 - 1 / n_grid, ...`` (``max_shrink * n_grid`` ratios, as
    AutoAWQ) whose 4-bit grid (:func:`fake_quantize`) gives the least mean squared error in the group's part
    of the output on the inputs ``x [..., K]`` (at most ``max_tokens`` of them, evenly spaced). An output whose
    error over all its groups the clipping would raise keeps its weights, so no output's error on those
    tokens grows."""
    out_features, in_features = weight.shape
    groups = in_features // group_size
    x = x.reshape(-1, in_features).float()
    x = x[::-(-x.shape[0] // max_tokens)]
    # a group's output error is d^T H d for its weight error d: H is the group's block of x^T x / T
    by_group = x.view(-1, groups, group_size).transpose(0, 1)
    blocks = by_group.transpose(1, 2) @ by_group / x.shape[0]
    ratios = 1 - torch.arange(int(max_shrink * n_grid)) / n_grid
    rows = max(1, CLIP_CHUNK // in_features)
    out = torch.empty_like(weight)
    for start in range(0, out_features, rows):
        w = weight[start:start + rows].float()
        grouped = w.view(-1, groups, group_size)
        amax = grouped.abs().amax(-1, keepdim=True)
        best_error = torch.full(grouped.shape[:2], float('inf'))
        best_bound = amax
        for ratio in ratios:
            bound = amax * ratio
            delta = (fake_quantize(grouped.clamp(-bound, bound).view_as(w), group_size) - w).view_as(grouped)
            delta = delta.transpose(0, 1)
            error = ((delta @ blocks) * delta).sum(-1).T
            better = error < best_error
            best_error = torch.where(better, error, best_error)
            best_bound = torch.where(better[..., None], bound, best_bound)
        clipped = grouped.clamp(-best_bound, best_bound).view_as(w)
        keep = (_output_error(fake_quantize(clipped, group_size) - w, x)
                <= _output_error(fake_quantize(w, group_size) - w, x))
        out[start:start + rows] = torch.where(keep[:, None], clipped, w)
    return out


def clip_layer(state: dict[str, torch.Tensor], layer: str, inputs: dict[str, torch.Tensor],
               scales: dict[str, torch.Tensor] | None, config: dict, group_size: int) -> None:
    """Clips (:func:`clip_weight`) the :data:`CLIPPED` projections of decoder layer ``layer``
    (``model.layers.<i>``) in ``state`` in place, each on its recorded calibration input (:func:`_layer_inputs`)
    divided by the :func:`search_scales` factors folded into the layer before (None: none were)."""
    group, head_dim = attention_shape(config)
    for projection, (reads, key) in CLIPPED.items():
        x = inputs[reads]
        if scales is not None:
            s = scales[key]
            x = x / (expand_kv(s, group, head_dim) if key == 'self_attn.v_proj' else s)
        name = f'{layer}.{projection}.weight'
        state[name] = clip_weight(state[name], x, group_size)


class _Fixed(nn.Module):
    """Stands in for a projection during the scale search: returns ``out`` whatever its input."""

    def __init__(self, out: torch.Tensor):
        super().__init__()
        self.out = out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out


def _mean_square(x: torch.Tensor, weight: torch.Tensor) -> float:
    """``mean((x @ weight.T)^2)`` with ``x`` and ``weight`` in bf16 (products summed in fp32)."""
    out = x @ weight.T
    return torch.linalg.vector_norm(out, dtype=torch.float32).item() ** 2 / out.numel()


def _search(error: Callable[[torch.Tensor], float], weight: torch.Tensor, x_mean: torch.Tensor, group_size: int,
            n_grid: int, expand: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The ``s`` (shaped as ``x_mean``) whose 4-bit ``Q(weight * s) / s`` gives the least ``error``, which
    gets the weight's change ``Q(weight * s) / s - weight`` in bf16; ``weight`` holds the rows of every
    linear of the group, ``expand`` maps ``s`` to its input channels (None: they are the same)."""
    best, best_error = None, float('inf')
    for step in range(n_grid + 1):
        s = x_mean.pow(step / n_grid).clamp_min(MIN_SCALE)
        s = s / (s.max() * s.min()).sqrt()
        full = expand(s) if expand else s
        e = error(fake_quantize(weight * full, group_size).div_(full).sub_(weight).bfloat16())
        if e < best_error:
            best, best_error = s, e
    return best


def _attention_error(attn: nn.Module, x: torch.Tensor, o_input: torch.Tensor,
                     attn_kwargs: dict) -> Callable[[torch.Tensor], float]:
    """The error of attention ``attn`` on ``x`` for a change of its stacked q/k/v rows: q/k/v are their
    unquantized outputs plus ``x @ change.T``, and the error is that of o_proj's output, for the change
    of its input from ``o_input`` (the unquantized one)."""
    names = ('q_proj', 'k_proj', 'v_proj')
    base = [getattr(attn, name)(x) for name in names]
    sizes = [b.shape[-1] for b in base]
    xb, o_weight = x.bfloat16(), attn.o_proj.weight.bfloat16()

    def error(change: torch.Tensor) -> float:
        stand_ins = {name: _Fixed(b + d) for name, b, d in zip(names, base, (xb @ change.T).float().split(sizes, -1))}
        originals = {name: getattr(attn, name) for name in (*names, 'o_proj')}
        try:
            for name, module in {**stand_ins, 'o_proj': nn.Identity()}.items():
                setattr(attn, name, module)
            out = attn(hidden_states=x, **attn_kwargs)[0]
        finally:
            for name, module in originals.items():
                setattr(attn, name, module)
        return _mean_square((out - o_input).bfloat16(), o_weight)
    return error


def _mlp_error(mlp: nn.Module, x: torch.Tensor) -> Callable[[torch.Tensor], float]:
    """The error of MLP ``mlp``'s output on ``x`` for a change of its stacked gate/up rows."""
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    hidden = mlp.act_fn(gate) * up
    xb, down = x.bfloat16(), mlp.down_proj.weight.bfloat16()

    def error(change: torch.Tensor) -> float:
        d_gate, d_up = (xb @ change.T).float().chunk(2, -1)
        changed = mlp.act_fn(d_gate.add_(gate)).mul_(d_up.add_(up)).sub_(hidden)
        return _mean_square(changed.bfloat16(), down)
    return error


def _layer_inputs(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> tuple[dict, dict, torch.Tensor]:
    """Runs ``layer``: the inputs of its q, o, gate and down projections, the keyword arguments of its
    attention, and its output."""
    inputs, attn_kwargs = {}, {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            inputs[name] = args[0]
        return hook

    def record_attention(module: nn.Module, args: tuple, kw: dict) -> None:
        attn_kwargs.update({k: v for k, v in kw.items() if k != 'hidden_states'})

    modules = {name: layer.get_submodule(name) for name in ('self_attn.q_proj', 'self_attn.o_proj',
                                                               'mlp.gate_proj', 'mlp.down_proj')}
    handles = [module.register_forward_pre_hook(record(name)) for name, module in modules.items()]
    handles.append(layer.self_attn.register_forward_pre_hook(record_attention, with_kwargs=True))
    try:
        out = layer(hidden, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return inputs, attn_kwargs, out[0] if isinstance(out, tuple) else out


class _Captured(Exception):
    pass


def _first_layer_inputs(model: nn.Module, input_ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The hidden states and keyword arguments (rotary embeddings, mask) the first decoder layer gets."""
    captured = {}

    def capture(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured['hidden'], captured['kwargs'] = args[0], kwargs
        raise _Captured

    handle = model.model.layers[0].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        model(input_ids, use_cache=False)
    except _Captured:
        pass
    finally:
        handle.remove()
    return captured['hidden'], captured['kwargs']


@torch.no_grad()
def _calibration_layers(model: nn.Module, input_ids: torch.Tensor) -> Iterator[tuple[nn.Module, dict, dict]]:
    """Each decoder layer of ``model`` on the calibration batch, with the inputs of its q, o, gate and down
    projections and its attention's keyword arguments (:func:`_layer_inputs`); every layer reads the
    unquantized output of the one before."""
    hidden, kwargs = _first_layer_inputs(model, input_ids)
    for layer in model.model.layers:
        inputs, attn_kwargs, hidden = _layer_inputs(layer, hidden, kwargs)
        yield layer, inputs, attn_kwargs


@torch.no_grad()
def search_scales(layer: nn.Module, inputs: dict[str, torch.Tensor], attn_kwargs: dict, config: dict,
                  group_size: int = 128, n_grid: int = 20) -> dict[str, torch.Tensor]:
    """AWQ's per-input-channel factors of one decoder layer (a transformers Llama/Qwen layer) from its
    calibration ``inputs`` and ``attn_kwargs`` (:func:`_calibration_layers`), keyed by the module they are
    folded into: ``input_layernorm``, ``post_attention_layernorm`` (the hidden size), ``self_attn.v_proj``
    (one per KV-head channel) and ``mlp.up_proj`` (the intermediate size)."""
    group, head_dim = attention_shape(config)
    attn, mlp = layer.self_attn, layer.mlp

    def mean(name: str) -> torch.Tensor:
        return inputs[name].abs().reshape(-1, inputs[name].shape[-1]).mean(0)

    def linear(x: torch.Tensor) -> Callable[[torch.Tensor], float]:
        xb = x.bfloat16()
        return lambda change: _mean_square(xb, change)

    def rows(*linears: nn.Linear) -> torch.Tensor:
        return torch.cat([linear.weight for linear in linears])

    o_input = inputs['self_attn.o_proj']
    return {
        'input_layernorm': _search(_attention_error(attn, inputs['self_attn.q_proj'], o_input, attn_kwargs),
                                   rows(attn.q_proj, attn.k_proj, attn.v_proj), mean('self_attn.q_proj'),
                                   group_size, n_grid),
        'self_attn.v_proj': _search(linear(o_input), attn.o_proj.weight,
                                    kv_shared(mean('self_attn.o_proj'), group, head_dim, 'mean'), group_size,
                                    n_grid, lambda s: expand_kv(s, group, head_dim)),
        'post_attention_layernorm': _search(_mlp_error(mlp, inputs['mlp.gate_proj']), rows(mlp.gate_proj, mlp.up_proj),
                                            mean('mlp.gate_proj'), group_size, n_grid),
        'mlp.up_proj': _search(linear(inputs['mlp.down_proj']), mlp.down_proj.weight, mean('mlp.down_proj'),
                               group_size, n_grid),
    }


def fold_scales(state: dict[str, torch.Tensor], layer: str, scales: dict[str, torch.Tensor], config: dict) -> None:
    """Folds :func:`search_scales`' factors of decoder layer ``layer`` (``model.layers.<i>``) into the fp32
    Hugging Face ``state`` in place."""
    group, head_dim = attention_shape(config)
    attn, mlp = f'{layer}.self_attn', f'{layer}.mlp'
    fold_norm(state, f'{layer}.input_layernorm', [f'{attn}.q_proj', f'{attn}.k_proj', f'{attn}.v_proj'],
              scales['input_layernorm'])
    fold_norm(state, f'{layer}.post_attention_layernorm', [f'{mlp}.gate_proj', f'{mlp}.up_proj'],
              scales['post_attention_layernorm'])
    fold_pair(state, f'{attn}.v_proj', f'{attn}.o_proj', scales['self_attn.v_proj'], group, head_dim)
    up = scales['mlp.up_proj']
    fold_pair(state, f'{mlp}.up_proj', f'{mlp}.down_proj', up, 1, up.numel())


def quantize(state: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """``state`` with every decoder projection's weight as AWQ's ``qweight``, ``qzeros`` and ``scales``."""
    out = {}
    for name, tensor in state.items():
        if is_projection(name):
            module = name.removesuffix('weight')
            out.update({module + kind: t for kind, t in awq_tensors(tensor, group_size).items()})
        else:
            out[name] = tensor
    return out


def auto_awq(model_path: str, out_dir: str, w_bits: int = 4, w_group_size: int = 128, calib_samples: int = 8,
             calib_seqlen: int = 512, search_scale: bool = True, apply_clip: bool = True) -> None:
    """Writes a 4-bit AWQ copy of ``model_path`` (a Hugging Face folder or a .gguf file) to ``out_dir``,
    calibrated on ``calib_samples`` slices of ``calib_seqlen`` tokens from the start of the shipped text
    (:func:`lmdeploy.lite.calibration_text`) in fp32 with transformers on the CPU. ``search_scale=False``
    skips the scale search, ``apply_clip=False`` the weight clipping; with neither, plain round to nearest in
    the same layout."""
    if w_bits != 4:
        raise ConfigError(f'auto_awq writes 4-bit weights (the AWQ format the engine serves), not {w_bits}')
    check_arguments(out_dir, w_group_size=w_group_size, calib_samples=calib_samples, calib_seqlen=calib_seqlen)
    source, config = load_source(model_path, 'auto_awq')
    state = load_float_state(source)
    bad = [f'{name} {tuple(t.shape)}' for name, t in state.items()
           if is_projection(name) and (t.shape[1] % w_group_size or t.shape[0] % 8)]
    if bad:
        raise ConfigError(f'AWQ needs outputs in multiples of 8 and inputs in groups of {w_group_size} '
                          f'(--w-group-size): {bad[0]}')
    quantization_config = {'quant_method': 'awq', 'bits': w_bits, 'group_size': w_group_size, 'zero_point': True,
                           'version': 'gemm'}
    if search_scale or apply_clip:
        input_ids = calibration_ids(source, calib_samples * calib_seqlen).view(calib_samples, calib_seqlen)
        layers = _calibration_layers(load_float_model(source), input_ids)
        for i, (layer, inputs, attn_kwargs) in enumerate(layers):
            scales = search_scales(layer, inputs, attn_kwargs, config, w_group_size) if search_scale else None
            if scales is not None:
                fold_scales(state, f'model.layers.{i}', scales, config)
            if apply_clip:
                clip_layer(state, f'model.layers.{i}', inputs, scales, config, w_group_size)
        quantization_config['calibration_tokens'] = int(input_ids.numel())
    write_checkpoint(source, out_dir, quantize(state, w_group_size), config, quantization_config)
