"""The rejection sampler reproduces the target distribution exactly (chi-square), a broken one does not."""

import pytest
import torch
from scipy.stats import chisquare

from engine.spec_decode.rejection import greedy_verify, race, rejection_sample

TRIALS = 20_000
TARGET = torch.tensor([0.05, 0.40, 0.10, 0.25, 0.20])  # q in the words: the target model
DRAFT = torch.tensor([0.30, 0.10, 0.35, 0.05, 0.20])  # p: the draft model


def first_tokens(sampler, draft_probs, generator):
    """One draft position per trial: the first output token of each trial."""
    vocab = TARGET.numel()
    draft_tokens = torch.multinomial(draft_probs.expand(TRIALS, vocab), 1, generator=generator)
    target = TARGET.expand(TRIALS, 2, vocab)
    draft = draft_probs.expand(TRIALS, 1, vocab)
    uniforms = torch.rand(TRIALS, 1, generator=generator)
    noise = torch.empty(TRIALS, vocab).exponential_(generator=generator)
    tokens, _ = sampler(target, draft_tokens, torch.ones(TRIALS, dtype=torch.long), draft, uniforms, noise)
    return tokens[:, 0]


def broken_sampler(target, draft_tokens, num_drafts, draft, uniforms, noise):
    """Resamples from the target on rejection instead of from the residual: biased."""
    accepted = uniforms[:, 0] * draft[:, 0].gather(1, draft_tokens).squeeze(1) < target[:, 0].gather(
        1, draft_tokens).squeeze(1)
    resampled = race(target[:, 0], noise)
    return torch.where(accepted, draft_tokens[:, 0], resampled)[:, None], None


def p_value(tokens):
    counts = torch.bincount(tokens, minlength=TARGET.numel()).double()
    return chisquare(counts.numpy(), (TARGET.double() * TRIALS).numpy()).pvalue


def test_output_follows_the_target_distribution():
    generator = torch.Generator().manual_seed(0)
    assert p_value(first_tokens(rejection_sample, DRAFT, generator)) > 0.01


def test_a_broken_sampler_fails_the_same_test():
    generator = torch.Generator().manual_seed(0)
    assert p_value(first_tokens(broken_sampler, DRAFT, generator)) < 1e-6


def test_deterministic_proposer_is_a_point_mass_draft():
    generator = torch.Generator().manual_seed(1)
    vocab = TARGET.numel()
    draft_tokens = torch.full((TRIALS, 1), 2)
    ones = torch.ones(TRIALS, dtype=torch.long)
    tokens, counts = rejection_sample(TARGET.expand(TRIALS, 2, vocab), draft_tokens, ones,
                                      None, torch.rand(TRIALS, 1, generator=generator),
                                      torch.empty(TRIALS, vocab).exponential_(generator=generator))
    assert p_value(tokens[:, 0]) > 0.01
    accepted = (counts == 2).double().mean().item()
    assert accepted == pytest.approx(TARGET[2].item(), abs=0.01)  # accepted with probability q(x)


def test_all_accepted_gives_a_bonus_token_and_padding_is_ignored():
    target = torch.zeros(1, 4, 5)
    target[0, :, 3] = 1.0
    draft_tokens = torch.tensor([[3, 3, 1]])
    tokens, counts = rejection_sample(target, draft_tokens, torch.tensor([2]), None, torch.zeros(1, 3),
                                      torch.ones(1, 5))
    assert counts.tolist() == [3] and tokens[0, :3].tolist() == [3, 3, 3]


def test_greedy_verification_accepts_exactly_the_argmax():
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    drafts = torch.tensor([[5, 6, 9], [5, 6, 7]])
    tokens, counts = greedy_verify(argmax, drafts, torch.tensor([3, 2]))
    assert counts.tolist() == [3, 3]
    assert tokens[0, :3].tolist() == [5, 6, 7] and tokens[1, :3].tolist() == [5, 6, 7]
    tokens, counts = greedy_verify(argmax, drafts, torch.tensor([0, 3]))
    assert counts.tolist() == [1, 4] and tokens[0, 0] == 5 and tokens[1].tolist() == [5, 6, 7, 8]
