"""DeepSeek-V4's attention: one shared key-value head (the key is the value), queries from a low-rank projection
normed per head without weights, interleaved rotary over each head's last ``qk_rope_head_dim`` features (undone on
the output), a sink logit per head, a grouped low-rank output projection; over a sliding window, plus in CSA and HCA
layers the compressed entries of earlier windows (CSA: those its lightning indexer selects). The cache layout and
the attention are ``kernels/compressed_attention.py``'s; the layer kinds are ``layer_types``'."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels.compressed_attention import (GATHER_ELEMENTS, CompressorColumns, PagedRows,
                                                           closing_rows, entry_positions, pooled_windows,
                                                           sink_attention, window_keys, write_rows)
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.quant import Layout, new_parameter
from lmdeploy.pytorch.step_context import StepContext

SLIDING, CSA, HCA = 'sliding_attention', 'compressed_sparse_attention', 'heavily_compressed_attention'


def layer_columns(hf: PretrainedConfig, kind: str) -> tuple[CompressorColumns | None, CompressorColumns | None]:
    """The compressor's and the indexer's columns in a cache row of a layer of ``kind`` (after its key-value)."""
    if kind == SLIDING:
        return None, None
    compressor = CompressorColumns(hf.head_dim, hf.head_dim, overlap=kind == CSA)
    if kind == HCA:
        return compressor, None
    return compressor, CompressorColumns(compressor.stop, hf.index_head_dim, overlap=True)


def cache_row_width(hf: PretrainedConfig) -> int:
    """The features each token caches in every layer: the widest row of the model's layer kinds."""
    widths = [hf.head_dim]
    for kind in set(hf.layer_types):
        widths.extend(cols.stop for cols in layer_columns(hf, kind) if cols is not None)
    return max(widths)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Fp32RMSNorm(nn.Module):
    """RMSNorm computed in fp32 with its weight kept in fp32, the result in the input's dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = new_parameter((size,), Layout(None, None), torch.float32)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h).to(x.dtype)


class V4Rotary:
    """The rotary of each of ``rope_parameters``' labels (``main``: sliding layers; ``compress``: CSA/HCA layers,
    their compressors and indexers), one angle per interleaved pair: ``cos, sin [T, rope_dim / 2]``."""

    def __init__(self, hf: PretrainedConfig):
        self.inv_freq, self.scaling = {}, {}
        for label, params in hf.rope_parameters.items():
            if not isinstance(params, dict):
                continue
            kind = params.get('rope_type', 'default')
            if kind == 'default':
                dim = int(hf.head_dim * params.get('partial_rotary_factor', 1.0))
                inv_freq = 1.0 / (params['rope_theta']**(torch.arange(0, dim, 2, dtype=torch.float) / dim))
                self.inv_freq[label], self.scaling[label] = inv_freq, 1.0
            else:
                self.inv_freq[label], self.scaling[label] = ROPE_INIT_FUNCTIONS[kind](hf, torch.device('cpu'),
                                                                                      layer_type=label)

    def __call__(self, label: str, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float().unsqueeze(-1) * self.inv_freq[label].to(positions.device)
        scaling = self.scaling[label]
        return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Turns neighbouring pairs of the last ``2 * cos.shape[-1]`` features of each head of ``x [T, H, D]`` (in fp32)."""
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(1)
    dim = cos.shape[-1]
    nope, rope = x[..., :-dim], x[..., -dim:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((nope, (rope.float() * cos + turned.float() * sin).to(x.dtype)), dim=-1)


@dataclass
class V4Step:
    """What every layer reads of a step: its context, each token's rows, the rotaries' angles and the token ids."""

    ctx: StepContext
    paged: PagedRows
    angles: dict[str, tuple[torch.Tensor, torch.Tensor]]
    input_ids: torch.Tensor


class Compressor(nn.Module):
    """Pools each window of ``ratio`` tokens into one entry: ``kv`` and ``gate`` projections of every token (cached
    in its row), a softmax of the gates plus ``ape`` over the window, the norm, and the rotary at the window's first
    position; with ``overlap`` (CSA) two series, the first of each window also pooled into the next one's entry."""

    def __init__(self, cfg: ModelConfig, columns: CompressorColumns, ratio: int):
        super().__init__()
        self.columns, self.ratio = columns, ratio
        self.wkv = Linear(cfg.hidden_size, columns.width)
        self.wgate = Linear(cfg.hidden_size, columns.width)
        self.ape = new_parameter((ratio, columns.width), Layout(None, None), torch.float32)
        self.norm = Fp32RMSNorm(columns.dim, cfg.hf_config.rms_norm_eps)

    def update(self, x: torch.Tensor, cache: torch.Tensor, step: V4Step, rotary: V4Rotary) -> None:
        """Caches this step's tokens' inputs, then the entry of each window one of them completes."""
        write_rows(cache, step.ctx, self.columns.inputs, torch.cat((self.wkv(x), self.wgate(x)), dim=-1))
        rows = closing_rows(step.paged.positions, self.ratio)
        if rows.numel() == 0:
            return
        entry = self.norm(pooled_windows(cache, step.paged, rows, self.columns, self.ratio, self.ape))
        cos, sin = rotary('compress', step.paged.positions[rows] - self.ratio + 1, entry.dtype)
        entry = rotate(entry.unsqueeze(1), cos, sin).squeeze(1)
        cache[step.ctx.kv_blocks[rows], step.ctx.kv_offsets[rows], self.columns.entry] = entry.to(cache.dtype)


class Indexer(nn.Module):
    """CSA's lightning indexer: a compressor of its own (``index_head_dim`` features, CSA's windows), queries from the
    attention's low-rank query, and per query the ``index_topk`` entries of the highest
    ``sum_h w_h relu(q_h . k)`` among those it may read."""

    def __init__(self, cfg: ModelConfig, columns: CompressorColumns, ratio: int):
        super().__init__()
        hf = cfg.hf_config
        self.num_heads, self.head_dim, self.top_k = hf.index_n_heads, hf.index_head_dim, hf.index_topk
        self.wq_b = Linear(hf.q_lora_rank, self.num_heads * self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.num_heads)
        self.compressor = Compressor(cfg, columns, ratio)

    def queries(self, x: torch.Tensor, q_lora: torch.Tensor, step: V4Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's rotated queries ``[T, H, D]`` and fp32 head weights ``[T, H]``."""
        q = rotate(self.wq_b(q_lora).view(-1, self.num_heads, self.head_dim), *step.angles['compress'])
        return q, self.weights_proj(x).float() * self.num_heads**-0.5

    def select(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
               valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries each query keeps of its row's ``keys [R, N, D]`` (readable where ``valid``): their indices
        ``[R, k]`` and which of those are readable (fewer than ``index_topk`` may be)."""
        dots = torch.einsum('rhd,rnd->rhn', q.float(), keys.float())
        scores = (F.relu(dots) * self.head_dim**-0.5 * weights.unsqueeze(-1)).sum(dim=1)
        scores = scores.masked_fill(~valid, float('-inf'))
        top = scores.topk(min(self.top_k, scores.shape[1]), dim=-1).indices
        return top, valid.gather(1, top)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: each of ``groups`` slices of the input ``[T, groups, in]`` by its own block of
    ``weight [groups * out, in]``; ``[T, groups, out]``."""

    def __init__(self, in_features: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = new_parameter((groups * out_features, in_features), Layout(None, None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)
        return torch.bmm(x.transpose(0, 1), blocks).transpose(0, 1)


class V4Attention(nn.Module):
    """The attention of a layer of ``kind`` (see the module's docstring)."""

    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        hf = cfg.hf_config
        self.num_heads, self.head_dim, self.groups = hf.num_attention_heads, hf.head_dim, hf.o_groups
        self.window, self.eps, self.rope = hf.sliding_window, hf.rms_norm_eps, 'main' if kind == SLIDING else 'compress'
        self.wq_a = Linear(cfg.hidden_size, hf.q_lora_rank)
        self.q_norm = Fp32RMSNorm(hf.q_lora_rank, hf.rms_norm_eps)
        self.wq_b = Linear(hf.q_lora_rank, self.num_heads * self.head_dim)
        self.wkv = Linear(cfg.hidden_size, self.head_dim)
        self.norm = Fp32RMSNorm(self.head_dim, hf.rms_norm_eps)
        self.wo_a = GroupedLinear(self.num_heads * self.head_dim // hf.o_groups, hf.o_lora_rank, hf.o_groups)
        self.wo_b = Linear(hf.o_groups * hf.o_lora_rank, cfg.hidden_size)
        self.attn_sink = new_parameter((self.num_heads,), Layout(None, None), torch.float32)
        compressor, indexer = layer_columns(hf, kind)
        self.ratio = hf.compress_rates[kind] if compressor is not None else 0
        self.compressor = Compressor(cfg, compressor, self.ratio) if compressor is not None else None
        self.indexer = Indexer(cfg, indexer, self.ratio) if indexer is not None else None

    def forward(self, x: torch.Tensor, cache: torch.Tensor, step: V4Step, rotary: V4Rotary) -> torch.Tensor:
        cos, sin = step.angles[self.rope]
        q_lora = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_lora).view(-1, self.num_heads, self.head_dim)
        q = rotate(unweighted_rms_norm(q, self.eps), cos, sin)
        kv = rotate(self.norm(self.wkv(x)).unsqueeze(1), cos, sin).squeeze(1)
        write_rows(cache, step.ctx, slice(0, self.head_dim), kv)
        for compressor in (self.compressor, self.indexer and self.indexer.compressor):
            if compressor is not None:
                compressor.update(x, cache, step, rotary)
        index_q = self.indexer.queries(x, q_lora, step) if self.indexer is not None else None
        out = torch.empty_like(q)
        num_rows = self.rows_at_once(step.paged.positions)
        for start in range(0, x.shape[0], num_rows):
            rows = torch.arange(start, min(start + num_rows, x.shape[0]), device=x.device)
            keys, allowed = window_keys(cache, step.paged, rows, self.window, self.head_dim)
            if self.compressor is not None:
                positions, valid = entry_positions(step.paged.positions[rows], self.ratio)
                if self.indexer is not None:
                    index_keys = step.paged.read(cache, rows, positions, self.indexer.compressor.columns.entry)
                    chosen, valid = self.indexer.select(index_q[0][rows], index_q[1][rows], index_keys, valid)
                    positions = positions.gather(1, chosen)
                entries = step.paged.read(cache, rows, positions, self.compressor.columns.entry)
                keys, allowed = torch.cat((keys, entries), dim=1), torch.cat((allowed, valid), dim=1)
            out[rows] = sink_attention(q[rows], keys, allowed, self.head_dim**-0.5, self.attn_sink)
        out = rotate(out, cos, -sin).view(x.shape[0], self.groups, -1)
        return self.wo_b(self.wo_a(out).flatten(1))

    def rows_at_once(self, positions: torch.Tensor) -> int:
        """How many queries gather their keys together: about ``GATHER_ELEMENTS`` features of keys (the window's,
        the entries': in CSA only the selected, after the indexer's keys of every entry)."""
        entries = (int(positions.max()) + 1) // self.ratio if self.ratio else 0
        features = (self.window + entries) * self.head_dim
        if self.indexer is not None:
            features = (self.window + min(entries, self.indexer.top_k)) * self.head_dim + entries * self.indexer.head_dim
        return max(1, GATHER_ELEMENTS // features)
