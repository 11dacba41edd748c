"""Sampler: top-k / top-p masks, greedy rows, seeded reproducibility independent of the batch."""

import math

import pytest
import torch

from engine.sampler import Sampler, apply_top_k, apply_top_p
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

NEG = float("-inf")


def seq(seq_id, **params):
    return Sequence(seq_id, str(seq_id), [1], SamplingParams(**params))


def test_top_k_keeps_exactly_the_k_largest_per_row():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [5.0, 1.0, 2.0, 0.0]])
    masked = apply_top_k(logits, torch.tensor([2, 0]))
    assert masked.tolist() == [[NEG, 4.0, 3.0, NEG], [5.0, 1.0, 2.0, 0.0]]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    kept = apply_top_p(logits, torch.tensor([0.75])).isfinite().tolist()
    assert kept == [[True, True, False, False]]
    kept = apply_top_p(logits, torch.tensor([0.81])).isfinite().tolist()
    assert kept == [[True, True, True, False]]
    assert apply_top_p(logits, torch.tensor([0.1])).isfinite().tolist() == [[True, False, False, False]]


def test_greedy_rows_take_the_argmax_even_in_a_sampled_batch():
    logits = torch.zeros(65, 50)
    logits[:, 7] = 0.01  # the argmax, barely: sampled, a row takes it one time in fifty
    tokens = Sampler(0)(logits, [seq(i, temperature=0) for i in range(64)] + [seq(64, temperature=1.0)])
    assert tokens[:64] == [7] * 64


def test_a_seeded_request_draws_the_same_tokens_whatever_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    alone = Sampler(1)(logits[:1], [seq(0, seed=42)])[0]
    a, b = seq(0, seed=42), seq(1, seed=42)
    first = [Sampler(7)(logits[:1], [a])[0] for _ in range(5)]
    mixed = [Sampler(9)(logits, [b, seq(2), seq(3)])[0] for _ in range(5)]
    assert first == mixed and first[0] == alone


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    logits = probs.log().repeat(4000, 1)
    sampler = Sampler(123)
    tokens = torch.tensor(sampler(logits, [seq(i) for i in range(4000)]))
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(8, 100)
    tokens = Sampler(5)(logits, [seq(i, temperature=5.0, top_k=1) for i in range(8)])
    assert tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0),
                                 dict(max_tokens=-3), dict(top_k=-5), dict(temperature="hot"), dict(n=0)])
def test_bad_sampling_params_raise_with_the_field_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_temperature_scales_before_softmax():
    logits = torch.tensor([[0.0, math.log(3.0)]]).repeat(3000, 1)  # p = 1/4, 3/4 at T=1
    tokens = torch.tensor(Sampler(3)(logits, [seq(i, temperature=1e6) for i in range(3000)]))
    assert abs(tokens.float().mean().item() - 0.5) < 0.05  # near uniform at a huge temperature
