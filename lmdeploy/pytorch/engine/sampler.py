"""Batched next-token sampling.

One call handles a whole engine step: penalties and masks, then greedy argmax or seeded sampling
with temperature, top-k, top-p and min-p. Every stage is vectorised over the batch and skipped
when no sequence needs it; only the random draw loops, because each sequence owns its generator.
Every row is processed with row-wise operations only, so a sequence gets the same token whatever
else is in the batch.
"""
from __future__ import annotations

import array
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from lmdeploy.messages import GenerationConfig
from lmdeploy.pytorch.device import HostCopy, to_device
from lmdeploy.pytorch.engine.guided import apply_grammars, needs_grammar
from lmdeploy.pytorch.engine.sequence import Sequence
from lmdeploy.pytorch.paging.scheduler import ScheduledSeq
from lmdeploy.pytorch.kernels import argmax

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


def _long(values: Iterable[int], device: torch.device) -> Tensor:
    """A long tensor from Python ints (through ``array``: far faster than ``torch.tensor`` on long lists)."""
    buf = array.array('q', values)
    if not buf:
        return torch.empty(0, dtype=torch.long, device=device)
    return to_device(torch.frombuffer(buf, dtype=torch.long), device)


def _values(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)


def _pairs(per_row: list[Iterable[int] | None], device: torch.device) -> tuple[Tensor, Tensor]:
    """Index pairs (row, token) for the tokens listed per row (None: the row has none)."""
    rows, counts, cols = [], [], []
    for i, toks in enumerate(per_row):
        if toks is not None:
            n = len(cols)
            cols.extend(toks)
            rows.append(i)
            counts.append(len(cols) - n)
    # output_size spares CUDA the host sync that would size the result.
    pair_rows = torch.repeat_interleave(_long(rows, device), _long(counts, device), output_size=len(cols))
    return pair_rows, _long(cols, device)


def _row_values(x: Tensor, values: list[float], rows: Tensor) -> Tensor:
    return _values(values, x.dtype, x.device)[rows]


def _needs_edit(seq: Sequence) -> bool:
    g = seq.gen_config
    return bool(g.logit_bias or g.repetition_penalty != 1.0 or g.presence_penalty or g.frequency_penalty
                or _stop_forbidden(seq))


def _apply_logit_bias(x: Tensor, seqs: list[Sequence]) -> None:
    """Add ``logit_bias`` (its token ids are ints: ``GenerationConfig`` turns decimal strings into them)."""
    V = x.shape[1]
    biases = [{t: float(b) for t, b in (s.gen_config.logit_bias or {}).items() if t < V} or None
              for s in seqs]
    rows, cols = _pairs(biases, x.device)
    if len(rows):
        bias = _values([b for d in biases if d for b in d.values()], x.dtype, x.device)
        x.index_put_((rows, cols), bias, accumulate=True)


def _apply_repetition_penalty(x: Tensor, seqs: list[Sequence]) -> None:
    """HF semantics over prompt and output tokens: positive logits divided, negative multiplied."""
    pens = [s.gen_config.repetition_penalty for s in seqs]
    rows, cols = _pairs([set(s.prompt_ids).union(s.output_ids) if p != 1.0 else None for s, p in zip(seqs, pens)],
                        x.device)
    if len(rows):
        p = _row_values(x, pens, rows)
        v = x[rows, cols]
        # a tiny penalty must not push a logit to inf (inf - inf is nan in the sampling arithmetic)
        big = torch.finfo(x.dtype).max
        x[rows, cols] = torch.where(v > 0, v / p, v * p).clamp_(-big, big)


def _apply_presence_frequency(x: Tensor, seqs: list[Sequence]) -> None:
    """OpenAI semantics over output tokens: ``-= frequency * count + presence * (count > 0)``."""
    cfgs = [s.gen_config for s in seqs]
    counts = [Counter(s.output_ids) if g.presence_penalty or g.frequency_penalty else None
              for s, g in zip(seqs, cfgs)]
    rows, cols = _pairs(counts, x.device)
    if len(rows):
        n = _values([c for cnt in counts if cnt for c in cnt.values()], x.dtype, x.device)
        freq = _row_values(x, [g.frequency_penalty for g in cfgs], rows)
        pres = _row_values(x, [g.presence_penalty for g in cfgs], rows)
        x[rows, cols] -= freq * n + pres


def _apply_min_new_tokens(x: Tensor, seqs: list[Sequence]) -> None:
    """Forbid the stop tokens until ``min_new_tokens`` tokens have been generated, and while a grammar waits
    for the marker after which it applies (the reply must not end before its format); a grammar that applies
    alone decides where its output ends."""
    V = x.shape[1]
    rows, cols = _pairs([[t for t in s.stop_ids if t < V] if _stop_forbidden(s) else None for s in seqs], x.device)
    if len(rows):
        x[rows, cols] = -math.inf


def _stop_forbidden(seq: Sequence) -> bool:
    if seq.grammar is not None:
        return not seq.grammar.active
    return seq.num_generated < seq.gen_config.min_new_tokens


def _draw_plain(x: Tensor, cfgs: list[GenerationConfig], inv_t: Tensor, u: Tensor) -> Tensor:
    """Rows without top-k/top-p: inverse-CDF draw over the whole (unsorted) row, after min-p."""
    w = x - x.amax(-1, keepdim=True)  # scaled after the shift, so that a low temperature cannot overflow it
    w.mul_(inv_t).exp_()  # probabilities relative to the most likely token
    if any(g.min_p > 0.0 for g in cfgs):
        w.masked_fill_(w < _values([g.min_p for g in cfgs], torch.float32, x.device)[:, None], 0.0)
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
    top_k = _values([min(g.top_k, width) or width for g in cfgs], torch.long, dev)[:, None]
    w = ((vals - vals[:, :1]) * inv_t).exp_()
    w.masked_fill_(torch.arange(width, device=dev) >= top_k, 0.0)
    no_k = _long([i for i, g in enumerate(cfgs) if not g.top_k], dev)
    if len(no_k):  # top-p over the whole row needs the row's full probability mass
        w[no_k] = torch.softmax((_pick(x, no_k) - vals[no_k, :1]) * inv_t[no_k], dim=-1).gather(1, ids[no_k])
    cdf = w.cumsum(-1)
    n = (w > 0).sum(-1, keepdim=True)
    covered = torch.ones(len(cfgs), dtype=torch.bool, device=dev)
    if any(g.top_p < 1.0 for g in cfgs):
        top_p = _values([g.top_p for g in cfgs], torch.float32, dev)[:, None]
        has_k = _values([g.top_k > 0 for g in cfgs], torch.bool, dev)[:, None]
        mass = torch.where(has_k, cdf.gather(1, top_k - 1), 1.0)  # top-p renormalises over the top-k
        n = torch.minimum(n, (cdf - w < top_p * mass).sum(-1, keepdim=True))
        covered = (has_k | (cdf[:, -1:] >= top_p) | (width == x.shape[1])).squeeze(1)
    if any(g.min_p > 0.0 for g in cfgs):
        min_p = _values([g.min_p for g in cfgs], torch.float32, dev)[:, None]
        n = torch.minimum(n, (w >= min_p * w[:, :1]).sum(-1, keepdim=True))
    n = n.clamp_min(1)
    pos = torch.searchsorted(cdf, u * cdf.gather(1, n - 1), right=True)
    return ids.gather(1, torch.minimum(pos, n - 1)).squeeze(1), covered


def _pick(t: Tensor, rows: Tensor) -> Tensor:
    """``t[rows]`` for ascending unique ``rows``, without the copy when they are all the rows."""
    return t if len(rows) == len(t) else t[rows]


def _one_pass(x: Tensor) -> bool:
    """Whether to draw every ranked row in one pass: on a GPU a full sort costs less than the host sync
    that finding the rows left over by a narrower slice needs."""
    return x.is_cuda


def _sample_rows(x: Tensor, seqs: list[Sequence]) -> Tensor:
    """Draw one token per row, each from one uniform of the sequence's own generator."""
    dev, V = x.device, x.shape[1]
    cfgs = [s.gen_config for s in seqs]
    inv_t = _values([1.0 / g.temperature for g in cfgs], torch.float32, dev)[:, None]
    u = _values([torch.rand((), generator=s.generator).item() for s in seqs], torch.float32, dev)[:, None]
    tokens = torch.empty(len(seqs), dtype=torch.long, device=dev)
    ranked = [i for i, g in enumerate(cfgs) if g.top_k or g.top_p < 1.0]
    plain = sorted(set(range(len(seqs))) - set(ranked))
    if plain:
        rows = _long(plain, dev)
        tokens[rows] = _draw_plain(_pick(x, rows), [cfgs[i] for i in plain], inv_t[rows], u[rows])
    if not ranked:
        return tokens
    ranked_cfgs = [cfgs[i] for i in ranked]
    first = max([g.top_k for g in ranked_cfgs] + [_TOP_P_SLICES[0] if any(not g.top_k for g in ranked_cfgs) else 0])
    widths = sorted({min(w, V) for w in (first, *_TOP_P_SLICES[1:], V) if w >= first})
    if _one_pass(x):
        widths = [min(first, V)] if all(g.top_k for g in ranked_cfgs) else [V]
    rows, row_list = _long(ranked, dev), ranked
    for width in widths[:-1]:  # top-p rows whose nucleus is wider than the slice go on to a wider one
        if not row_list:
            break
        got, covered = _draw_ranked(_pick(x, rows), [cfgs[i] for i in row_list], inv_t[rows], u[rows], width)
        tokens[rows[covered]] = got[covered]
        rows = rows[~covered]
        row_list = rows.tolist()
    if row_list:
        tokens[rows] = _draw_ranked(_pick(x, rows), [cfgs[i] for i in row_list], inv_t[rows], u[rows], widths[-1])[0]
    return tokens


def depends_on_outputs(seq: Sequence) -> bool:
    """Whether choosing this sequence's next token needs its latest token on the host: penalties over the
    output so far, or a grammar."""
    g = seq.gen_config
    return bool(g.repetition_penalty != 1.0 or g.presence_penalty or g.frequency_penalty or seq.grammar)


@dataclass
class PendingSample:
    """Tokens chosen on the device (and logprobs where asked), on their way to the host.

    ``token_ids`` stays on the device for the next step's inputs; :meth:`result` waits for the copy.
    """

    token_ids: Tensor
    logprob_rows: list[int]
    logprob_counts: list[int]
    copy: HostCopy

    def result(self) -> SampleOutput:
        tokens, *logprob_parts = self.copy.wait()
        tokens = tokens.tolist()
        if not self.logprob_rows:
            return SampleOutput(token_ids=tokens, logprobs=None)
        chosen, top_v, top_i = (part.tolist() for part in logprob_parts)
        out: list[dict[int, float] | None] = [None] * len(tokens)
        for j, (i, k) in enumerate(zip(self.logprob_rows, self.logprob_counts)):
            out[i] = {tokens[i]: chosen[j], **dict(zip(top_i[j][:k], top_v[j][:k]))}
        return SampleOutput(token_ids=tokens, logprobs=out)


def _logprobs(logits: Tensor, token_ids: Tensor, rows: list[int], counts: list[int]) -> list[Tensor]:
    """Raw-logit logprobs of the chosen token and the top ``max(counts)`` tokens of each asking row."""
    if not rows:
        return []
    row_t = _long(rows, logits.device)
    lp = torch.log_softmax(_pick(logits, row_t).float(), dim=-1)
    chosen = lp.gather(1, _pick(token_ids, row_t)[:, None]).squeeze(1)
    return [chosen, *lp.topk(max(counts), dim=-1)]


def record_prompt_logprobs(logits: Tensor, prefill: list[ScheduledSeq]) -> None:
    """Appends to each prefill chunk's sequence the prompt logprobs of the positions it asked for
    (``Sequence.prompt_logprob_positions``, before the chunk counts as computed), from their logits in
    chunk order."""
    spans = [(item.seq, item.seq.prompt_logprob_positions(item.seq.num_computed,
                                                          item.seq.num_computed + item.num_tokens))
             for item in prefill]
    targets = [seq.prompt_ids[p + 1] for seq, positions in spans for p in positions]
    top = max(seq.gen_config.prompt_logprobs for seq, positions in spans if positions)
    chosen, *top_parts = HostCopy(_logprobs(logits, _long(targets, logits.device), list(range(len(targets))),
                                            [top] * len(targets))).wait()
    chosen, top_v, top_i = chosen.tolist(), *(part.tolist() for part in top_parts)
    row = 0
    for seq, positions in spans:
        k = seq.gen_config.prompt_logprobs
        for _ in positions:
            entry = {targets[row]: chosen[row], **dict(zip(top_i[row][:k], top_v[row][:k]))}
            seq.prompt_logprobs.append(entry)
            row += 1


def launch_sample(logits: Tensor, seqs: list[Sequence]) -> PendingSample:
    """Choose the next token for each sequence from ``logits`` [B, V] (the last position per row), on
    the logits' device, and start copying the choice to the host without waiting for it.

    Logprobs are the log-softmax of the raw logits, before any penalty, grammar or temperature.
    """
    assert logits.dim() == 2 and logits.shape[0] == len(seqs), 'one row of logits per sequence'
    x = logits
    logprob_rows = [i for i, s in enumerate(seqs) if s.gen_config.logprobs is not None]
    if any(_needs_edit(s) for s in seqs):
        x = logits.to(torch.float32, copy=True)
        _apply_logit_bias(x, seqs)
        _apply_repetition_penalty(x, seqs)
        _apply_presence_frequency(x, seqs)
        _apply_min_new_tokens(x, seqs)
    grammars = [s.grammar for s in seqs]
    if needs_grammar(grammars):
        if x is logits and logprob_rows:
            x = logits.clone()
        apply_grammars(x, grammars)
    sampled = [i for i, s in enumerate(seqs) if not s.gen_config.is_greedy]
    if len(sampled) < len(seqs):
        token_ids = argmax(x)
    else:
        token_ids = torch.empty(len(seqs), dtype=torch.long, device=x.device)
    if sampled:
        rows = _long(sampled, x.device)
        token_ids[rows] = _sample_rows(_pick(x, rows).float(), [seqs[i] for i in sampled])
    counts = [seqs[i].gen_config.logprobs for i in logprob_rows]
    return PendingSample(token_ids, logprob_rows, counts,
                         HostCopy([token_ids, *_logprobs(logits, token_ids, logprob_rows, counts)]))


def sample(logits: Tensor, seqs: list[Sequence]) -> SampleOutput:
    """:func:`launch_sample`, waiting for its result."""
    return launch_sample(logits, seqs).result()
