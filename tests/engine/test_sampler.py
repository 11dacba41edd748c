"""Sampler: top-k / top-p masks, greedy rows, seeded reproducibility independent of the batch."""

import math

import pytest
import torch

from engine.kernels.cpu_kernel import sampling_library
from engine.sampler import Sampler, apply_top_k, apply_top_p, exponential_noise, exponential_race, noise_key, noise_rows
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


def race_cases() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Rows of a 49,152-token vocabulary: peaked and flat, bfloat16-rounded (many tied logits), masked, one-hot,
    and the edge rows (all -inf, +inf, NaN); temperatures from 0.05 to 1e6; keys over the whole 64-bit range."""
    generator = torch.Generator().manual_seed(0)
    vocab = 49_152
    rows = [torch.randn(vocab, generator=generator) * scale for scale in (0.3, 1.0, 3.0, 8.0, 20.0)]
    rows.append((torch.randn(vocab, generator=generator) * 4).bfloat16().float())
    masked = torch.randn(vocab, generator=generator)
    masked[torch.rand(vocab, generator=generator) < 0.9] = NEG
    rows += [masked, torch.full((vocab,), NEG), torch.zeros(vocab)]
    edge = torch.randn(vocab, generator=generator)
    edge[[77, 5000]] = float("inf")
    rows.append(edge.clone())
    edge[123] = float("nan")
    rows.append(edge)
    temperatures = [1.0, 0.7, 1.0, 0.05, 2.0, 1.0, 1.3, 1.0, 1e6, 1.0, 1.0]
    keys = [noise_key(seed, position) for seed, position in zip(range(11), range(0, 1100, 100), strict=True)]
    keys[5], keys[8] = (1 << 64) - 1, 1 << 63
    return torch.stack(rows), torch.tensor(temperatures, dtype=torch.float64), keys


def test_the_c_race_draws_the_same_tokens_as_the_torch_fallback():
    assert sampling_library() is not None, "this machine has a C compiler: the sampling kernel must build"
    logits, temperatures, keys = race_cases()
    c = exponential_race(logits, temperatures, keys)
    assert torch.equal(c, exponential_race(logits, temperatures, keys, kernel=False))
    assert c[7] == 0 and c[9] == 77 and c[10] == 0  # all -inf; the first +inf; a NaN row, as torch's argmax
    for seed in range(40):  # many draws over a small bfloat16 vocabulary: ties and near-ties in every row
        small = (torch.randn(64, 300, generator=torch.Generator().manual_seed(seed)) * 2).bfloat16().float()
        keys = [noise_key(seed, position) for position in range(64)]
        t = torch.full((64,), 0.9, dtype=torch.float64)
        assert torch.equal(exponential_race(small, t, keys), exponential_race(small, t, keys, kernel=False))
    noise = noise_rows(keys[:3], 1000)
    assert torch.equal(noise, exponential_noise(keys[:3], 1000, torch.device("cpu")).float())
    assert abs(noise.mean().item() - 1) < 0.05 and noise.min() > 0  # Exp(1)


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(temperature=1.5, top_k=4)])
def test_sampled_tokens_follow_the_softmax_over_many_positions(params):
    from scipy.stats import chisquare

    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -0.5, -1.0, -3.0, NEG])
    draws = 40_000
    sequence = seq(0, seed=5, **params)
    keys = [noise_key(sequence.sample_seed, position) for position in range(draws)]
    tokens = Sampler.race(logits.repeat(draws, 1), [sequence.params] * draws, keys)
    expected = Sampler.probabilities(logits[None], [sequence.params])[0]
    counts = torch.bincount(tokens, minlength=8)
    kept = expected > 0
    assert counts[~kept].sum() == 0  # masked (top-k, -inf) tokens never drawn
    expected = expected[kept].double() / expected[kept].double().sum()
    assert chisquare(counts[kept].numpy(), (expected * draws).numpy()).pvalue > 1e-3


def test_a_seeded_request_samples_by_position_alone_batched_or_all_at_once():
    torch.manual_seed(1)
    logits = torch.randn(6, 5, 3000)  # 6 rows in the batch, 5 positions
    sampler = Sampler(0)
    alone, others = seq(0, seed=42, temperature=0.8), [seq(i, temperature=1.2, seed=i) for i in range(1, 6)]
    batched = seq(9, seed=42, temperature=0.8)
    for position in range(5):
        token = sampler(logits[0, position][None], [alone])[0]
        in_batch = Sampler(7)(logits[:, position].flip(0), others[::-1] + [batched])[-1]
        assert token == in_batch
        alone.append_token(token)
        batched.append_token(token)
    at_once = Sampler(3).sample_positions(logits[0], seq(11, seed=42, temperature=0.8))
    assert at_once.tolist() == alone.output_token_ids
    assert len(set(alone.output_token_ids)) > 1
    invariant = Sampler(0)
    invariant.batch_invariant = True  # the mode does not change a seeded request's noise
    assert invariant(logits[0, 0][None], [seq(12, seed=42, temperature=0.8)])[0] == alone.output_token_ids[0]


def test_unseeded_rows_draw_fresh_noise_each_time():
    logits = torch.zeros(2, 1000)
    sampler = Sampler(0)
    draws = [tuple(sampler(logits, [seq(0), seq(1)])) for _ in range(5)]
    assert len(set(draws)) == 5 and all(a != b for a, b in draws)
    assert tuple(Sampler(0)(logits, [seq(0), seq(1)])) == draws[0]  # keyed by the engine's seed and a count
    assert tuple(Sampler(1)(logits, [seq(0), seq(1)])) != draws[0]
