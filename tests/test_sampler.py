"""Batched sampler: greedy, seeded sampling, filters, penalties, logprobs and batch independence."""
from __future__ import annotations

import itertools

import pytest
import torch

from lmdeploy.messages import GenerationConfig
from lmdeploy.pytorch.engine.sampler import sample
from lmdeploy.pytorch.engine.sequence import Sequence

_ids = itertools.count()


def _seq(prompt: list[int] | None = None, output: list[int] | None = None, eos: frozenset[int] = frozenset(),
         **cfg) -> Sequence:
    seq = Sequence(next(_ids), list(prompt or [1]), GenerationConfig(**cfg), eos)
    seq.output_ids = list(output or [])
    return seq


def _frequencies(logits: torch.Tensor, seqs: int = 1000, steps: int = 20, **cfg) -> torch.Tensor:
    """Empirical distribution of ``seqs * steps`` seeded draws from one row of logits."""
    batch = [_seq(do_sample=True, random_seed=i, **cfg) for i in range(seqs)]
    drawn = [t for _ in range(steps) for t in sample(logits.expand(seqs, -1), batch).token_ids]
    return torch.bincount(torch.tensor(drawn), minlength=logits.shape[-1]) / len(drawn)


def _logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_batch_is_argmax_and_leaves_logits_untouched():
    logits = _logits(8, 1000)
    before = logits.clone()
    seqs = [_seq(), _seq(do_sample=True, top_k=1), _seq(do_sample=True, temperature=0.0)] + [_seq() for _ in range(5)]
    out = sample(logits, seqs)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None
    assert torch.equal(logits, before)


def test_top_k_one_and_tiny_top_p_pick_the_argmax():
    logits = _logits(6, 500, seed=1)
    seqs = [_seq(do_sample=True, top_k=1, random_seed=i) for i in range(3)]
    seqs += [_seq(do_sample=True, top_p=1e-6, temperature=2.0, random_seed=i) for i in range(3)]
    for _ in range(5):
        assert sample(logits, seqs).token_ids == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_seed_dependent():
    logits = _logits(1, 200, seed=2)

    def run(seed: int) -> list[int]:
        seq = _seq(do_sample=True, temperature=1.5, random_seed=seed)
        return [sample(logits, [seq]).token_ids[0] for _ in range(30)]

    assert run(7) == run(7)
    assert run(7) != run(8)


MIXED = [dict(do_sample=True, temperature=0.9), dict(do_sample=True, top_k=20), dict(do_sample=True, top_p=0.8),
         dict(do_sample=True, top_k=50, top_p=0.9, temperature=1.3), dict(do_sample=True, min_p=0.05),
         dict(), dict(do_sample=True, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4),
         dict(do_sample=True, top_k=5, logit_bias={3: 5.0}, logprobs=3), dict(repetition_penalty=1.2),
         dict(do_sample=True, top_p=0.95, temperature=3.0),  # nucleus wider than any slice: full sort
         dict(do_sample=True, top_k=2000, top_p=0.5, min_p=0.01, min_new_tokens=3, logprobs=0)]


def test_batch_composition_does_not_change_a_sequence_result():
    vocab, steps = 49152, 3
    logits = [_logits(len(MIXED), vocab, seed=s) for s in range(steps)]

    def make() -> list[Sequence]:
        return [_seq(prompt=[1, 2, 3, 4], output=[5, 5, 6], eos=frozenset({7}), random_seed=100 + i, **c)
                for i, c in enumerate(MIXED)]

    alone = []
    for i, seq in enumerate(make()):
        outs = [sample(logits[s][i:i + 1], [seq]) for s in range(steps)]
        alone.append(([o.token_ids[0] for o in outs], [o.logprobs[0] if o.logprobs else None for o in outs]))
    seqs = make()
    order = [3, 0, 8, 10, 5, 1, 7, 2, 9, 6, 4]  # a different row order, all in one batch
    batched = {i: ([], []) for i in order}
    for s in range(steps):
        rows = logits[s][order]
        before = rows.clone()
        out = sample(rows, [seqs[i] for i in order])
        assert torch.equal(rows, before)
        for row, i in enumerate(order):
            batched[i][0].append(out.token_ids[row])
            batched[i][1].append(out.logprobs[row])
    for i in range(len(MIXED)):
        assert batched[i] == alone[i], MIXED[i]


def test_min_p_keeps_only_tokens_near_the_top():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    seqs = [_seq(do_sample=True, temperature=1.0, min_p=0.5, random_seed=i) for i in range(300)]
    drawn = set(sample(logits.expand(300, -1), seqs).token_ids)
    assert drawn == {0, 1}  # 0.1 < 0.5 * 0.5


def test_top_k_and_top_p_distributions():
    logits = torch.log(torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05]]))
    for cfg, expect in [(dict(top_k=3), [0.4, 0.25, 0.2, 0, 0]), (dict(top_p=0.6), [0.4, 0.25, 0, 0, 0]),
                        (dict(top_k=4, top_p=0.7), [0.4, 0.25, 0.2, 0, 0]),
                        (dict(top_k=100, top_p=0.99), [0.4, 0.25, 0.2, 0.1, 0.05])]:  # top_k > vocab
        freq = _frequencies(logits, temperature=1.0, **cfg)
        expect = torch.tensor(expect) / sum(expect)
        assert torch.allclose(freq, expect, atol=0.015), (cfg, freq)


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -3.0]])
    for temperature in (0.5, 1.0, 2.0):
        freq = _frequencies(logits, temperature=temperature)
        expect = torch.softmax(logits[0] / temperature, -1)
        assert (freq - expect).abs().max() < 0.012, (temperature, freq, expect)


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, 1.9, -5.0], [-1.0, -1.1, -5.0]])
    plain = [_seq(prompt=[0]), _seq(prompt=[0])]
    assert sample(logits, plain).token_ids == [0, 0]
    # Positive 2.0 is divided (1.67 < 1.9); negative -1.0 is multiplied (-1.2 < -1.1).
    penalised = [_seq(prompt=[0], repetition_penalty=1.2), _seq(prompt=[2], output=[0], repetition_penalty=1.2)]
    assert sample(logits, penalised).token_ids == [1, 1]


def test_presence_and_frequency_penalties_use_output_tokens_only():
    logits = torch.tensor([[2.0, 1.5, 0.0]] * 3)
    seqs = [_seq(prompt=[0, 0, 0], presence_penalty=0.4, frequency_penalty=0.4),  # prompt is ignored
            _seq(output=[0], presence_penalty=0.6),  # 2.0 - 0.6 < 1.5
            _seq(output=[0, 0], frequency_penalty=0.2)]  # 2.0 - 0.4 > 1.5 ...
    assert sample(logits, seqs).token_ids == [0, 1, 0]
    seqs[2].output_ids.append(0)  # ... 2.0 - 0.6 < 1.5
    assert sample(logits[2:], seqs[2:]).token_ids == [1]


def test_min_new_tokens_blocks_stop_tokens():
    logits = torch.tensor([[0.0, 1.0, 5.0, 4.0]])
    seq = _seq(eos=frozenset({2}), stop_token_ids=[3], min_new_tokens=2)
    assert sample(logits, [seq]).token_ids == [1]
    seq.output_ids += [1, 1]
    assert sample(logits, [seq]).token_ids == [2]
    sampled = _seq(eos=frozenset({2}), stop_token_ids=[3], min_new_tokens=5, do_sample=True, random_seed=0)
    assert set(sample(logits.expand(50, -1), [sampled] * 50).token_ids) <= {0, 1}


def test_logit_bias_forces_a_token():
    logits = _logits(2, 300, seed=3)
    seqs = [_seq(logit_bias={17: 100.0}), _seq(do_sample=True, random_seed=1, logit_bias={'42': 100.0})]
    assert sample(logits, seqs).token_ids == [17, 42]


def test_logprobs_are_raw_log_softmax_with_top_n():
    logits = _logits(3, 100, seed=4)
    expect = torch.log_softmax(logits, -1)
    seqs = [_seq(logprobs=4, logit_bias={int(logits[0].argmin()): 100.0}), _seq(), _seq(logprobs=0)]
    out = sample(logits, seqs)
    chosen = out.token_ids[0]
    assert chosen == int(logits[0].argmin())
    top = expect[0].topk(4).indices.tolist()
    assert list(out.logprobs[0]) == [chosen] + top
    for tok, lp in out.logprobs[0].items():
        assert lp == pytest.approx(expect[0, tok].item(), abs=1e-5)
    assert out.logprobs[1] is None
    assert out.logprobs[2] == {out.token_ids[2]: pytest.approx(expect[2].max().item(), abs=1e-5)}


def test_one_pass_draw_of_the_gpu_gives_the_sliced_draws_tokens(monkeypatch):
    """On CUDA every ranked row is drawn in one pass (no host sync); the tokens are those of the CPU's
    narrower-slices-first path."""
    from lmdeploy.pytorch.engine import sampler
    vocab, steps = 49152, 3
    logits = [_logits(len(MIXED), vocab, seed=s) for s in range(steps)]

    def draws(one_pass: bool) -> list[list[int]]:
        monkeypatch.setattr(sampler, '_one_pass', lambda x: one_pass)
        seqs = [_seq(prompt=[1, 2, 3, 4], output=[5, 5, 6], eos=frozenset({7}), random_seed=100 + i, **c)
                for i, c in enumerate(MIXED)]
        return [sample(logits[s], seqs).token_ids for s in range(steps)]

    assert draws(True) == draws(False)
