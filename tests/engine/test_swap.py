"""Swap preemption: the host block pool's bookkeeping on hand-made cases (swap out and back in without recomputing,
a full host pool recomputes, the length threshold of the default mode, an aborted swapped sequence frees its host
blocks, a block copied on write in the step is read from its source), then whole engines on a tiny random model and
on the real model in float32: the same greedy tokens swapping, recomputing and without preemption."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.block_pool import KVCacheManager
from engine.config import EngineConfig
from engine.prometheus import EngineMetrics
from engine.sampling_params import SamplingParams as Params
from engine.scheduler import Scheduler, SchedulerLimits
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.step_types import ModelRunnerOutput
from engine.swap import SWAP_MIN_COMPUTED_TOKENS, SwapSpace
from tokenmill.bench.tiny_model import save_random_model

EOS = 2


def make_scheduler(num_blocks: int, host_blocks: int, mode: str | None = "swap", block_size: int = 4,
                   budget: int = 32) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=False)
    limits = SchedulerLimits(8, budget, 1024, preemption_mode=mode)
    return Scheduler(limits, kv, frozenset({EOS}), swap=SwapSpace(host_blocks))


def make_seq(seq_id: int, prompt_len: int, max_tokens: int = 8, n: int = 1) -> Sequence:
    prompt = list(range(10 + 100 * seq_id, 10 + 100 * seq_id + prompt_len))
    return Sequence(seq_id, f"r{seq_id}", prompt, Params(max_tokens=max_tokens, temperature=0, n=n))


def step(sched: Scheduler):
    out = sched.schedule()
    sampled = [s.seq_id for s in out.sampled_seqs()]
    sched.update_from_output(out, ModelRunnerOutput.of({seq_id: [5] for seq_id in sampled}))
    return out


def run_until(sched: Scheduler, done, limit: int = 50) -> list:
    plans = []
    for _ in range(limit):
        plans.append(step(sched))
        if done(plans[-1]):
            return plans
    raise AssertionError("the condition never came")


def test_a_victim_swaps_out_keeps_its_progress_and_swaps_back_in_without_recomputing():
    sched = make_scheduler(num_blocks=7, host_blocks=8)  # 6 usable blocks of 4 tokens: two sequences of 12
    first, second = make_seq(0, 8), make_seq(1, 8)
    sched.add(first)
    sched.add(second)
    run_until(sched, lambda out: second.block_table and second.num_computed_tokens == 12)
    device_blocks = list(second.block_table[:3])
    out = step(sched)  # the first needs a fourth block: the second, admitted last, is swapped out
    assert out.preempted == [second] and [s.seq for s in out.scheduled] == [first]
    assert second.status is SequenceStatus.SWAPPED and list(sched.swapped) == [second]
    assert second.num_computed_tokens == 12 and second.block_table == [] and len(second.host_block_table) == 3
    assert out.blocks_to_swap_out == list(zip(device_blocks, second.host_block_table, strict=True))
    assert sched.swap.num_free_blocks == 5 and sched.swap.stats.blocks_swapped_out == 3
    host_blocks = list(second.host_block_table)
    plans = run_until(sched, lambda out: out.blocks_to_swap_in)
    back = plans[-1]
    assert first.is_finished and second.status is SequenceStatus.RUNNING
    assert back.blocks_to_swap_in == list(zip(host_blocks, second.block_table[:3], strict=True))
    assert [(s.seq, s.num_new_tokens, s.sample) for s in back.scheduled] == [(second, 1, True)]  # no recompute
    assert second.host_block_table == [] and sched.swap.num_free_blocks == 8
    assert sched.swap.stats.blocks_swapped_in == 3 and second.num_preemptions == 1
    run_until(sched, lambda out: second.is_finished)
    assert second.output_token_ids == [5] * 8
    assert sched.kv.pool.num_free_blocks == sched.kv.usable_blocks and not sched.has_unfinished


def test_waiting_requests_wait_while_a_swapped_one_cannot_come_back():
    sched = make_scheduler(num_blocks=7, host_blocks=8)
    first, second = make_seq(0, 8), make_seq(1, 8)
    sched.add(first)
    sched.add(second)
    run_until(sched, lambda out: out.preempted)
    late = make_seq(2, 4)
    sched.add(late)  # it would fit beside the first, but the swapped one comes back first
    plans = run_until(sched, lambda out: out.blocks_to_swap_in)
    assert all(late not in [s.seq for s in out.scheduled] for out in plans[:-1])
    assert [s.seq for s in plans[-1].scheduled][:1] == [second]  # then the waiting one, if it fits


def test_a_full_host_pool_recomputes_instead():
    sched = make_scheduler(num_blocks=7, host_blocks=2)  # the victim needs 3 host blocks
    first, second = make_seq(0, 8), make_seq(1, 8)
    sched.add(first)
    sched.add(second)
    out = run_until(sched, lambda out: out.preempted)[-1]
    assert second.status is SequenceStatus.WAITING and second.num_computed_tokens == 0
    assert not out.blocks_to_swap_out and not sched.swapped and sched.swap.num_free_blocks == 2
    assert sched.swap.stats.blocks_swapped_out == 0 and sched.num_preemptions == 1


@pytest.mark.parametrize(("mode", "long_swaps", "short_swaps"), [(None, True, False), ("swap", True, True),
                                                                 ("recompute", False, False)])
def test_the_mode_picks_swap_or_recompute_per_victim(mode, long_swaps, short_swaps):
    sched = make_scheduler(num_blocks=64, host_blocks=64, mode=mode, block_size=16, budget=1024)
    long, short = make_seq(0, SWAP_MIN_COMPUTED_TOKENS), make_seq(1, SWAP_MIN_COMPUTED_TOKENS - 16)
    sched.add(long)
    sched.add(short)
    step(sched)
    for seq, swaps in ((long, long_swaps), (short, short_swaps)):
        sched._preempt(seq)
        assert seq.status is (SequenceStatus.SWAPPED if swaps else SequenceStatus.WAITING)
        assert seq.num_computed_tokens == (seq.num_tokens - 1 if swaps else 0)


def test_an_aborted_swapped_sequence_frees_its_host_blocks_and_its_pending_copies():
    sched = make_scheduler(num_blocks=64, host_blocks=16)
    seq = make_seq(0, 10)
    sched.add(seq)
    step(sched)
    sched._preempt(seq)  # outside a step: its copies wait for the next step that runs
    assert seq.status is SequenceStatus.SWAPPED and len(sched.swap.pending_out) == 3
    sched.finish(seq, FinishReason.ABORT)
    assert seq.is_finished and not sched.swapped and not sched.has_unfinished
    assert sched.swap.num_free_blocks == 16 and sched.swap.pending_out == [] and seq.host_block_table == []


def test_swap_outs_wait_for_a_step_that_runs():
    sched = make_scheduler(num_blocks=64, host_blocks=16)
    seq = make_seq(0, 10)
    sched.add(seq)
    step(sched)
    sched._preempt(seq)
    pending = list(sched.swap.pending_out)
    sched.limits.max_num_seqs = 0  # nothing can run: the plan is empty, and its copies would never be made
    out = step(sched)
    assert out.is_empty and out.blocks_to_swap_out == [] and sched.swap.pending_out == pending
    sched.limits.max_num_seqs = 8
    out = step(sched)  # swapped straight back in: the copies out come first in the same step
    assert out.blocks_to_swap_out == pending and [h for _, h in pending] == [h for h, _ in out.blocks_to_swap_in]
    assert sched.swap.pending_out == []


def test_a_block_copied_on_write_in_this_step_is_swapped_from_its_source():
    kv = KVCacheManager(16, 4, enable_caching=False)
    parent = make_seq(0, 6, n=2)
    kv.admit(parent, [])
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    parent.append_token(5)
    child = parent.fork(1, 1)
    kv.share_blocks(child)
    shared = list(parent.block_table)
    assert kv.allocate_slots(parent, 1)  # writes into the shared partial block: a copy, made when the step runs
    assert kv.pending_copies == [(shared[1], parent.block_table[1])]
    swap = SwapSpace(4)
    assert swap.swap_out(parent, kv)
    assert [device for device, _ in swap.pending_out] == shared  # the copy holds nothing yet: its source is read
    assert kv.pending_copies == [] and parent.block_table == []
    assert kv.pool.ref_counts[shared[0]] == kv.pool.ref_counts[shared[1]] == 1  # the child's references remain


def test_config_validates_the_options():
    assert EngineConfig(preemption_mode="swap", swap_space=0.5).swap_space == 0.5
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig(swap_space=-1)


# -- whole engines ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_random_model(path)
    return path


def tiny_prompts(count: int) -> list[list[int]]:
    return [[3 + (7 * i + 3 * j) % 900 for j in range(40 + 12 * i)] for i in range(count)]


def generate(path, prompts, params, **config) -> tuple[list[list[list[int]]], LLM]:
    llm = LLM(str(path), dtype="float32", num_threads=2, **config)
    outs = llm.generate(prompts, params)
    return [[list(c.token_ids) for c in o.outputs] for o in outs], llm


def assert_drained(llm: LLM) -> None:
    engine = llm.engine
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.usable_blocks
    swap = engine.scheduler.swap
    assert swap.num_free_blocks == swap.num_blocks and not engine.scheduler.swapped
    stats = engine.get_stats()
    assert stats.kv_blocks_swapped_out == stats.kv_blocks_swapped_in


def test_tiny_model_swaps_and_recomputes_to_the_same_tokens(tiny_dir):
    prompts = tiny_prompts(8)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    small = dict(num_kv_blocks=14, max_num_batched_tokens=64)
    reference, _ = generate(tiny_dir, prompts, greedy)
    swapped, llm = generate(tiny_dir, prompts, greedy, preemption_mode="swap", **small)
    recomputed, other = generate(tiny_dir, prompts, greedy, preemption_mode="recompute", **small)
    assert swapped == reference and recomputed == reference
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_swapped_out > 0
    assert other.engine.get_stats().num_preemptions > 0 and other.engine.get_stats().kv_blocks_swapped_out == 0
    assert_drained(llm)


def test_tiny_model_forked_samples_swap_to_the_same_tokens(tiny_dir):
    prompts = tiny_prompts(4)
    seeded = [SamplingParams(max_tokens=20, temperature=1.0, seed=7 + i, n=3, ignore_eos=True) for i in range(4)]
    small = dict(num_kv_blocks=16, max_num_batched_tokens=64)
    reference, _ = generate(tiny_dir, prompts, seeded)
    swapped, llm = generate(tiny_dir, prompts, seeded, preemption_mode="swap", **small)
    assert swapped == reference and llm.engine.get_stats().kv_blocks_swapped_out > 0
    assert_drained(llm)


def test_tiny_model_a_tiny_swap_space_falls_back_to_recompute(tiny_dir):
    prompts = tiny_prompts(8)
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    small = dict(num_kv_blocks=14, max_num_batched_tokens=64)
    reference, _ = generate(tiny_dir, prompts, greedy)
    llm = LLM(str(tiny_dir), dtype="float32", num_threads=2, preemption_mode="swap", swap_space=0, **small)
    assert llm.engine.scheduler.swap.num_blocks == 0
    outs = llm.generate(prompts, greedy)
    assert [[list(o.outputs[0].token_ids)] for o in outs] == reference
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.kv_blocks_swapped_out == 0


def test_tiny_model_counts_swaps_in_prometheus(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", num_threads=2, preemption_mode="swap", num_kv_blocks=14,
              max_num_batched_tokens=64)
    engine = llm.engine
    metrics = EngineMetrics(engine, model_name="tiny", gauge_interval_s=0).attach()
    host_bytes = engine.runner.transfer.bytes_per_block
    assert engine.scheduler.swap.num_blocks == 4 * 2**30 // host_bytes  # the default 4 GiB in the pool's blocks
    llm.generate(tiny_prompts(8), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    stats, labels = engine.get_stats(), {"model_name": "tiny"}
    value = metrics.registry.get_sample_value
    assert value("tokenmill:kv_blocks_swapped_out_total", labels) == stats.kv_blocks_swapped_out > 0
    assert value("tokenmill:kv_blocks_swapped_in_total", labels) == stats.kv_blocks_swapped_in > 0
    assert value("tokenmill:num_requests_swapped", labels) == 0
    assert engine.runner.transfer.host_capacity < engine.scheduler.swap.num_blocks  # grown as used, not 4 GiB


def test_real_model_swap_and_recompute_give_the_unpreempted_greedy_tokens(model_dir, tokenizer):
    """Several long-ish prompts in a pool too small for them: swapping and recomputing both preempt, and the
    float32 greedy tokens are those of a run with a pool large enough for all of them."""
    from tests.engine.identity import long_prompts

    prompts = long_prompts(tokenizer, 4)  # 120 to 363 tokens, 66 blocks with their outputs
    greedy = SamplingParams(max_tokens=24, temperature=0)
    small = dict(num_kv_blocks=30, max_num_batched_tokens=64)  # admitted in chunks, then they outgrow the pool
    reference, _ = generate(model_dir, prompts, greedy)
    swapped, llm = generate(model_dir, prompts, greedy, preemption_mode="swap", **small)
    recomputed, other = generate(model_dir, prompts, greedy, preemption_mode="recompute", **small)
    stats, other_stats = llm.engine.get_stats(), other.engine.get_stats()
    print(f"swap: {stats.num_preemptions} preemptions, {stats.kv_blocks_swapped_out} blocks out; recompute: "
          f"{other_stats.num_preemptions} preemptions, {other_stats.computed_prefill_tokens} tokens prefilled")
    assert swapped == reference and recomputed == reference
    assert stats.num_preemptions > 0 and stats.kv_blocks_swapped_out > 0
    assert other_stats.num_preemptions > 0 and other_stats.kv_blocks_swapped_out == 0
    assert stats.computed_prefill_tokens < other_stats.computed_prefill_tokens  # swapping recomputed nothing
    assert_drained(llm)


def test_cli_options_reach_the_engine_settings_only_when_given():
    import argparse

    from tokenmill.options import add_engine_options, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    defaults = engine_kwargs(parser.parse_args([]))
    assert "preemption_mode" not in defaults and "swap_space" not in defaults
    given = engine_kwargs(parser.parse_args(["--preemption-mode", "swap", "--swap-space", "0.5"]))
    assert given["preemption_mode"] == "swap" and given["swap_space"] == 0.5
    assert EngineConfig.from_kwargs(**given).preemption_mode == "swap"


def test_bench_swap_help_loads_no_torch():
    import subprocess
    import sys

    code = ("import sys; from tokenmill.cli import main\n"
            "try:\n    main(['bench', 'swap', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--modes" in proc.stdout and proc.stdout.strip().endswith("False")
