"""The adaptive controller picks the k that maximises expected tokens per second, or none."""

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.cost import StepCost
from engine.spec_decode.decoder import AdaptiveControl


def control(dense: dict[int, float], accepted: float, tested: float, **settings) -> AdaptiveControl:
    ctl = AdaptiveControl(SpeculativeConfig("ngram", num_speculative_tokens=5, **settings), StepCost(dense))
    ctl.accepted, ctl.tested = accepted, tested
    return ctl


def test_a_flat_cost_curve_and_high_acceptance_take_every_draft():
    ctl = control({1: 0.03, 64: 0.03}, accepted=9, tested=10)
    assert ctl.lookahead(1) == 5


def test_the_cheapest_row_count_wins_on_a_stepped_cost_curve():
    # 1-3 rows cost the same, 4+ twice as much: two drafts at batch 1 is the best buy
    ctl = control({1: 0.02, 3: 0.02, 4: 0.04, 6: 0.04, 64: 0.2}, accepted=8, tested=10)
    assert ctl.lookahead(1) == 2


def test_large_batches_and_low_acceptance_do_not_speculate_except_to_probe():
    ctl = control({1: 0.02, 64: 0.15, 128: 0.3}, accepted=8, tested=10, probe_every=4)
    assert ctl.lookahead(64) == 0  # 128 tokens double the cost, 1.8 expected tokens do not pay for it
    low = control({1: 0.02, 2: 0.03, 6: 0.04}, accepted=1, tested=10, probe_every=3)
    assert [low.lookahead(1) for _ in range(6)] == [0, 0, 5, 0, 0, 5]


def test_estimates_move_with_what_is_accepted():
    ctl = control({1: 0.02, 6: 0.021}, accepted=4, tested=5)
    for _ in range(60):
        ctl.record(offered=1, proposed=1, tested=1, accepted=0)
    assert ctl.acceptance < 0.05 and ctl.lookahead(1) == 0
    for _ in range(60):
        ctl.record(offered=1, proposed=1, tested=5, accepted=5)
    assert ctl.acceptance > 0.9 and ctl.lookahead(1) == 5


def test_step_cost_interpolates_and_learns_the_overhead():
    cost = StepCost({1: 0.010, 4: 0.040})
    assert abs(cost(2) - 0.020) < 1e-9 and abs(cost(8) - 0.080) < 1e-9
    cost.observe(1, 0.015)
    assert abs(cost(1) - 0.015) < 1e-9
