"""Batched next-token sampling.

One call handles a whole engine step: penalties and masks, then greedy argmax or seeded sampling
with temperature, top-k, top-p and min-p. Every stage is vectorised over the batch and skipped
when no sequence needs it; only the random draw loops, because each sequence owns its generator.
Every row is processed with row-wise operations only, so a sequence gets the same token whatever
else is in the batch.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from lmdeploy.messages import GenerationConfig
from lmdeploy.pytorch.engine.sequence import Sequence

# Rows with top-p but no top-k look at this many best tokens first, then at more (finally all) while
# the nucleus does not fit; a full sort of the vocabulary is rarely needed.
_TOP_P_SLICES = (256, 4096)


@dataclass
class SampleOutput:
    """The token chosen for each sequence, and its logprobs where the request asked for them.

    ``logprobs[i]`` maps token id to logprob: the chosen token plus the top ``gen_config.logprobs``
    tokens. It is None for sequences that did not ask; ``logprobs`` itself is None when none did.
    """

    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None


def _long(values: list[int], device: torch.device) -> Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _needs_edit(seq: Sequence) -> bool:
    g = seq.gen_config
    return bool(g.logit_bias or g.repetition_penalty != 1.0 or g.presence_penalty or g.frequency_penalty
                or len(seq.output_ids) < g.min_new_tokens)


def _apply_logit_bias(x: Tensor, seqs: list[Sequence]) -> None:
    rows, cols, bias = [], [], []
    for i, seq in enumerate(seqs):
        for tok, b in (seq.gen_config.logit_bias or {}).items():
            if 0 <= int(tok) < x.shape[1]:
                rows.append(i), cols.append(int(tok)), bias.append(float(b))
    if rows:
        x.index_put_((_long(rows, x.device), _long(cols, x.device)),
                     torch.tensor(bias, dtype=x.dtype, device=x.device), accumulate=True)


def _apply_repetition_penalty(x: Tensor, seqs: list[Sequence]) -> None:
    """HF semantics over prompt and output tokens: positive logits divided, negative multiplied."""
    rows, cols, pens = [], [], []
    for i, seq in enumerate(seqs):
        p = seq.gen_config.repetition_penalty
        if p != 1.0:
            seen = set(seq.prompt_ids)
            seen.update(seq.output_ids)
            rows += [i] * len(seen)
            cols += seen
            pens += [p] * len(seen)
    if rows:
        idx = (_long(rows, x.device), _long(cols, x.device))
        p = torch.tensor(pens, dtype=x.dtype, device=x.device)
        v = x[idx]
        x[idx] = torch.where(v > 0, v / p, v * p)


def _apply_presence_frequency(x: Tensor, seqs: list[Sequence]) -> None:
    """OpenAI semantics over output tokens: ``-= frequency * count + presence * (count > 0)``."""
    rows, cols, subs = [], [], []
    for i, seq in enumerate(seqs):
        g = seq.gen_config
        if g.presence_penalty or g.frequency_penalty:
            for tok, n in Counter(seq.output_ids).items():
                rows.append(i), cols.append(tok), subs.append(g.frequency_penalty * n + g.presence_penalty)
    if rows:
        idx = (_long(rows, x.device), _long(cols, x.device))
        x[idx] = x[idx] - torch.tensor(subs, dtype=x.dtype, device=x.device)


def _apply_min_new_tokens(x: Tensor, seqs: list[Sequence]) -> None:
    rows, cols = [], []
    for i, seq in enumerate(seqs):
        if len(seq.output_ids) < seq.gen_config.min_new_tokens:
            stops = [t for t in seq.stop_ids if t < x.shape[1]]
            rows += [i] * len(stops)
            cols += stops
    if rows:
        x[_long(rows, x.device), _long(cols, x.device)] = -math.inf


def _draw_plain(x: Tensor, cfgs: list[GenerationConfig], inv_t: Tensor, u: Tensor) -> Tensor:
    """Rows without top-k/top-p: inverse-CDF draw over the whole (unsorted) row, after min-p."""
    w = x * inv_t
    w.sub_(w.amax(-1, keepdim=True)).exp_()  # probabilities relative to the most likely token
    if any(g.min_p > 0.0 for g in cfgs):
        w.masked_fill_(w < torch.tensor([g.min_p for g in cfgs], device=x.device)[:, None], 0.0)
    cdf = w.cumsum_(-1)
    total = cdf[:, -1:].contiguous()
    last = torch.searchsorted(cdf, total)  # the last token with a nonzero weight
    return torch.minimum(torch.searchsorted(cdf, u * total, right=True), last).squeeze(1)


def _draw_ranked(x: Tensor, cfgs: list[GenerationConfig], inv_t: Tensor, u: Tensor,
                 width: int) -> tuple[Tensor, Tensor]:
    """Rows with top-k and/or top-p: draw among the ``width`` best tokens of each row.

    Returns the tokens and, per row, whether the slice was wide enough: a row with top-p but no top-k
    whose nucleus reaches past the slice must be redone with the full row. Every quantity is a
    per-row prefix (cumulative sums over the sorted slice), so the slice width, which depends on the
    batch, never changes a row's result.
    """
    dev = x.device
    vals, ids = x.topk(width, dim=-1)
    top_k = torch.tensor([g.top_k or width for g in cfgs], device=dev)[:, None]
    w = ((vals - vals[:, :1]) * inv_t).exp_()
    w.masked_fill_(torch.arange(width, device=dev) >= top_k, 0.0)
    no_k = _long([i for i, g in enumerate(cfgs) if not g.top_k], dev)
    if len(no_k):  # top-p over the whole row needs the row's full probability mass
        w[no_k] = torch.softmax(_pick(x, no_k) * inv_t[no_k], dim=-1).gather(1, ids[no_k])
    cdf = w.cumsum(-1)
    n = (w > 0).sum(-1, keepdim=True)
    covered = torch.ones(len(cfgs), dtype=torch.bool, device=dev)
    if any(g.top_p < 1.0 for g in cfgs):
        top_p = torch.tensor([g.top_p for g in cfgs], device=dev)[:, None]
        has_k = torch.tensor([g.top_k > 0 for g in cfgs], device=dev)[:, None]
        mass = torch.where(has_k, cdf.gather(1, top_k - 1), 1.0)  # top-p renormalises over the top-k
        n = torch.minimum(n, (cdf - w < top_p * mass).sum(-1, keepdim=True))
        covered = (has_k | (cdf[:, -1:] >= top_p) | (width == x.shape[1])).squeeze(1)
    if any(g.min_p > 0.0 for g in cfgs):
        min_p = torch.tensor([g.min_p for g in cfgs], device=dev)[:, None]
        n = torch.minimum(n, (w >= min_p * w[:, :1]).sum(-1, keepdim=True))
    n = n.clamp_min(1)
    pos = torch.searchsorted(cdf, u * cdf.gather(1, n - 1), right=True)
    return ids.gather(1, torch.minimum(pos, n - 1)).squeeze(1), covered


def _pick(t: Tensor, rows: Tensor) -> Tensor:
    """``t[rows]``, without the copy when ``rows`` is every row in order."""
    return t if len(rows) == len(t) else t[rows]


def _sample_rows(x: Tensor, seqs: list[Sequence]) -> Tensor:
    """Draw one token per row, each from one uniform of the sequence's own generator."""
    dev, V = x.device, x.shape[1]
    cfgs = [s.gen_config for s in seqs]
    inv_t = torch.tensor([1.0 / g.temperature for g in cfgs], device=dev)[:, None]
    u = torch.tensor([torch.rand((), generator=s.generator).item() for s in seqs], device=dev)[:, None]
    tokens = torch.empty(len(seqs), dtype=torch.long, device=dev)
    ranked = [i for i, g in enumerate(cfgs) if g.top_k or g.top_p < 1.0]
    plain = _long(sorted(set(range(len(seqs))) - set(ranked)), dev)
    if len(plain):
        tokens[plain] = _draw_plain(_pick(x, plain), [cfgs[i] for i in plain.tolist()], inv_t[plain], u[plain])
    first = max([g.top_k for g in cfgs] + [_TOP_P_SLICES[0] if any(not g.top_k for g in cfgs) else 0])
    widths = sorted({min(w, V) for w in (first, *_TOP_P_SLICES[1:], V) if w >= first})
    rows = _long(ranked, dev)
    for width in widths:  # top-p rows whose nucleus is wider than the slice go on to a wider one
        if not len(rows):
            break
        got, covered = _draw_ranked(_pick(x, rows), [cfgs[i] for i in rows.tolist()], inv_t[rows], u[rows], width)
        tokens[rows[covered]] = got[covered]
        rows = rows[~covered]
    return tokens


def _logprobs(logits: Tensor, token_ids: Tensor, seqs: list[Sequence]) -> list[dict[int, float] | None] | None:
    rows = [i for i, s in enumerate(seqs) if s.gen_config.logprobs is not None]
    if not rows:
        return None
    row_t = _long(rows, logits.device)
    lp = torch.log_softmax(logits[row_t].float(), dim=-1)
    chosen = lp.gather(1, token_ids[row_t][:, None]).squeeze(1).tolist()
    n = max(seqs[i].gen_config.logprobs for i in rows)
    top_v, top_i = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    out: list[dict[int, float] | None] = [None] * len(seqs)
    for j, i in enumerate(rows):
        d = {int(token_ids[i]): chosen[j]}
        k = seqs[i].gen_config.logprobs
        d.update(zip(top_i[j][:k], top_v[j][:k]))
        out[i] = d
    return out


def sample(logits: Tensor, seqs: list[Sequence]) -> SampleOutput:
    """Choose the next token for each sequence from ``logits`` [B, V] (the last position per row).

    Logprobs are the log-softmax of the raw logits, before any penalty or temperature.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(seqs), 'one row of logits per sequence'
    x = logits
    if any(_needs_edit(s) for s in seqs):
        x = logits.float().clone()
        _apply_logit_bias(x, seqs)
        _apply_repetition_penalty(x, seqs)
        _apply_presence_frequency(x, seqs)
        _apply_min_new_tokens(x, seqs)
    greedy = [s.gen_config.is_greedy for s in seqs]
    if all(greedy):
        token_ids = x.argmax(-1)
    else:
        rows = [i for i, g in enumerate(greedy) if not g]
        if len(rows) == len(seqs):
            token_ids = _sample_rows(x.float(), seqs)
        else:
            token_ids = x.argmax(-1)
            row_t = _long(rows, x.device)
            token_ids[row_t] = _sample_rows(x[row_t].float(), [seqs[i] for i in rows])
    return SampleOutput(token_ids=token_ids.tolist(), logprobs=_logprobs(logits, token_ids, seqs))
