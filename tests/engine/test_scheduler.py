"""Scheduler on hand-made cases: chunk sizes, decode-first order, admission limits, preemption order."""

from engine.block_pool import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.step_types import ModelRunnerOutput

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=128, caching=False):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(SchedulerLimits(max_num_seqs, budget, max_model_len), kv, frozenset({EOS}))


def make_seq(seq_id, prompt_len, max_tokens=8, first_token=10):
    prompt = list(range(first_token, first_token + prompt_len))
    return Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))


def plan_of(out):
    return [(s.seq.seq_id, s.num_new_tokens, s.sample) for s in out.scheduled]


def tokens(out, *token_lists):
    """The runner's output giving the plan's sampled sequences these token lists, in plan order."""
    return ModelRunnerOutput.of(dict(zip([s.seq_id for s in out.sampled_seqs()], token_lists, strict=True)))


def step(sched, token=5):
    out = sched.schedule()
    finished = sched.update_from_output(out, tokens(out, *[[token]] * len(out.sampled_seqs())))
    return out, finished


def test_long_prompt_is_prefilled_in_budget_sized_chunks_then_decodes():
    sched = make_scheduler(budget=8)
    seq = make_seq(0, 20)
    sched.add(seq)
    chunks = []
    for _ in range(4):
        out, _ = step(sched)
        chunks.append(plan_of(out))
    assert chunks == [[(0, 8, False)], [(0, 8, False)], [(0, 4, True)], [(0, 1, True)]]
    assert seq.num_computed_tokens == 21 and seq.num_tokens == 22


def test_running_decodes_are_scheduled_before_new_prefills_under_the_budget():
    sched = make_scheduler(budget=10)
    a, b = make_seq(0, 6), make_seq(1, 12, first_token=50)
    sched.add(a)
    out, _ = step(sched)
    assert plan_of(out) == [(0, 6, True)]
    sched.add(b)
    out, _ = step(sched)
    assert plan_of(out) == [(0, 1, True), (1, 9, False)]  # decode first, prefill gets the rest
    out, _ = step(sched)
    assert plan_of(out) == [(0, 1, True), (1, 3, True)]


def test_max_num_seqs_caps_admission():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add(make_seq(i, 4, first_token=10 * i + 10))
    out, _ = step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2]


def test_block_tables_get_exact_block_ids_and_grow_only_at_block_boundaries():
    sched = make_scheduler(block_size=4)
    a, b = make_seq(0, 4), make_seq(1, 5, first_token=40)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert a.block_table == [1] and b.block_table == [2, 3]
    step(sched)  # a computes its 5th token: needs a new block; b's 6th fits in block 3
    assert a.block_table == [1, 4] and b.block_table == [2, 3]


def test_preemption_takes_the_most_recently_admitted_sequence_and_resumes_it_first():
    # 7 usable blocks of 4 tokens; three 7-token prompts take 2 blocks each (one block left).
    sched = make_scheduler(num_blocks=8, block_size=4, max_model_len=64)
    seqs = [make_seq(i, 7, max_tokens=5, first_token=10 * i + 10) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out, _ = step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1, 2]
    assert [s.block_table for s in seqs] == [[1, 2], [3, 4], [5, 6]]
    out, _ = step(sched)  # position 7 still fits in each second block
    assert not out.preempted
    out, _ = step(sched)  # position 8 needs a third block each: only block 7 is free
    assert [s.seq_id for s in out.preempted] == [2]
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]
    assert seqs[0].block_table == [1, 2, 7] and seqs[1].block_table == [3, 4, 6]  # 2's blocks freed tail first
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].num_computed_tokens == 0
    assert seqs[2].block_table == [] and sched.num_preemptions == 1
    assert list(sched.waiting) == [seqs[2]]


def test_a_sequence_that_preempts_itself_stops_the_loop():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    a, b = make_seq(0, 4, max_tokens=4), make_seq(1, 4, max_tokens=4, first_token=40)
    sched.add(a)
    sched.add(b)
    step(sched)  # a -> block 1, b -> block 2 (first token sampled)
    out, _ = step(sched)  # both need a second block: only block 3 is free
    assert [s.seq.seq_id for s in out.scheduled] == [0] and [s.seq_id for s in out.preempted] == [1]
    assert a.block_table == [1, 3]


def test_finish_on_eos_stop_token_and_length():
    sched = make_scheduler()
    eos_seq = make_seq(0, 3)
    stop_seq = Sequence(1, "r1", [20, 21, 22], SamplingParams(max_tokens=8, stop_token_ids=[7]))
    length_seq = make_seq(2, 3, max_tokens=1, first_token=30)
    for seq in (eos_seq, stop_seq, length_seq):
        sched.add(seq)
    out = sched.schedule()
    finished = sched.update_from_output(out, tokens(out, [EOS], [7], [5]))
    assert [s.finish_reason for s in finished] == [FinishReason.STOP, FinishReason.STOP, FinishReason.LENGTH]
    assert eos_seq.stop_reason == EOS and stop_seq.stop_reason == 7
    assert sched.kv.pool.num_free_blocks == sched.kv.usable_blocks and not sched.running


def test_ignore_eos_keeps_going():
    sched = make_scheduler()
    seq = Sequence(0, "r0", [20, 21], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add(seq)
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, tokens(out, [EOS]))
    assert seq.output_token_ids == [EOS] * 3 and seq.finish_reason is FinishReason.LENGTH


def test_requests_that_can_never_fit_are_rejected_with_a_reason():
    sched = make_scheduler(num_blocks=5, block_size=4, max_model_len=40)
    too_long = make_seq(0, 35, max_tokens=8)
    too_big_for_pool = make_seq(1, 14, max_tokens=8)  # 22 tokens -> 6 blocks > 4 usable
    assert not sched.add(too_long) and not sched.add(too_big_for_pool)
    assert too_long.finish_reason is FinishReason.ERROR and "max_model_len (40)" in too_long.error
    assert "needs 6 KV blocks but the pool has only 4" in too_big_for_pool.error
    assert not sched.has_unfinished


def test_admission_prefers_a_request_whose_prefix_is_cached_within_the_lookahead():
    kv = KVCacheManager(64, 4, enable_caching=True)
    sched = Scheduler(SchedulerLimits(2, 64, 128, admission_lookahead=4), kv, frozenset({EOS}))
    template_a = list(range(100, 112))
    first_a = Sequence(0, "a0", template_a + [1], SamplingParams(max_tokens=2))
    other_b = Sequence(1, "b0", list(range(200, 212)) + [1], SamplingParams(max_tokens=2))
    second_a = Sequence(2, "a1", template_a + [2], SamplingParams(max_tokens=2))
    sched.add(first_a)
    step(sched)  # a0 computes and caches template A
    sched.add(other_b)
    sched.add(second_a)
    out, _ = step(sched)
    admitted = [s.seq.seq_id for s in out.scheduled if s.seq is not first_a]
    assert admitted == [2] and second_a.num_cached_tokens == 12
    assert other_b.admission_skips == 1 and list(sched.waiting) == [other_b]


def test_strict_fcfs_and_preempted_heads_are_not_overtaken():
    kv = KVCacheManager(64, 4, enable_caching=True)
    sched = Scheduler(SchedulerLimits(8, 64, 128, admission_lookahead=1), kv, frozenset({EOS}))
    template = list(range(100, 112))
    cached = Sequence(0, "a0", template + [1], SamplingParams(max_tokens=2))
    sched.add(cached)
    step(sched)
    head = Sequence(1, "b0", list(range(200, 212)), SamplingParams(max_tokens=2))
    hit = Sequence(2, "a1", template + [2], SamplingParams(max_tokens=2))
    sched.add(head)
    sched.add(hit)
    assert sched._next_waiting()[0] is head
    sched.limits.admission_lookahead = 8
    assert sched._next_waiting()[0] is hit
    head.num_preemptions = 1
    assert sched._next_waiting()[0] is head


def test_draft_slots_are_taken_for_decodes_only_and_rejected_ones_released():
    sched = make_scheduler(block_size=4, budget=32)
    seq = make_seq(0, 4, max_tokens=20)
    sched.add(seq)
    out = sched.schedule(num_spec_tokens=3)
    assert out.spec_lookahead == {}  # a prefill gets no drafts
    sched.update_from_output(out, tokens(out, [5]))
    out = sched.schedule(num_spec_tokens=3)
    assert out.spec_lookahead == {0: 3} and len(seq.block_table) == 2  # positions 4..7
    out.spec_token_ids = {0: [6, 7, 8]}
    sched.update_from_output(out, tokens(out, [6, 9]))  # one draft accepted, then a recovered token
    assert seq.output_token_ids == [5, 6, 9] and seq.num_computed_tokens == 6
    assert len(seq.block_table) == 2
    out = sched.schedule(num_spec_tokens=3)  # positions 6..9: a third block for the drafts
    assert out.spec_lookahead == {0: 3} and len(seq.block_table) == 3
    sched.update_from_output(out, tokens(out, [1]))  # every draft rejected: the third block goes back
    assert len(seq.block_table) == 2 and sched.kv.pool.num_free_blocks == sched.kv.usable_blocks - 2


def test_drafts_stop_at_max_tokens_and_at_a_finishing_token():
    sched = make_scheduler(block_size=4)
    seq = make_seq(0, 4, max_tokens=3)
    sched.add(seq)
    step(sched)
    out = sched.schedule(num_spec_tokens=8)
    assert out.spec_lookahead == {0: 1}  # room for 2 more tokens: 1 draft + 1 sampled
    finished = sched.update_from_output(out, tokens(out, [EOS, 7]))
    assert finished == [seq] and seq.output_token_ids == [5, EOS] and seq.finish_reason is FinishReason.STOP


def test_the_watermark_does_not_keep_a_request_out_of_an_idle_engine():
    kv = KVCacheManager(5, 4, enable_caching=False, watermark_blocks=1)
    sched = Scheduler(SchedulerLimits(8, 32, 64), kv, frozenset({EOS}))
    whole_pool, small = make_seq(0, 14, max_tokens=2), make_seq(1, 3, max_tokens=2, first_token=50)
    sched.add(whole_pool)  # 16 tokens: all 4 usable blocks
    sched.add(small)
    out, _ = step(sched)
    assert plan_of(out) == [(0, 14, True)]  # admitted with nothing running; small waits for blocks
    step(sched)
    out, _ = step(sched)
    assert plan_of(out) == [(1, 3, True)] and whole_pool.finish_reason is FinishReason.LENGTH


def test_a_waiting_sequence_that_cannot_run_even_alone_fails_alone():
    sched = make_scheduler(num_blocks=4, block_size=4)
    impossible, fine = make_seq(0, 20), make_seq(1, 3, max_tokens=2, first_token=50)
    sched.waiting.append(impossible)  # past add()'s checks: the scheduler's own safety net
    sched.add(fine)
    out = sched.schedule()
    assert out.failed == [impossible] and out.is_empty
    assert impossible.finish_reason is FinishReason.ERROR and "nothing else running" in impossible.error
    out, _ = step(sched)
    assert plan_of(out) == [(1, 3, True)]


def test_n_above_max_num_seqs_is_rejected():
    sched = make_scheduler(max_num_seqs=2)
    seq = Sequence(0, "r0", [5, 6], SamplingParams(n=3))
    assert not sched.add(seq) and "n (3) exceeds max_num_seqs (2)" in seq.error


def test_forked_samples_decode_before_a_running_prefill_chunk():
    sched = make_scheduler(budget=8, max_model_len=256)
    forked = Sequence(0, "f", [10, 11, 12, 13, 14], SamplingParams(n=3, max_tokens=6, ignore_eos=True))
    long = make_seq(1, 60, max_tokens=2, first_token=100)
    sched.add(forked)
    sched.add(long)
    out, _ = step(sched)
    assert plan_of(out) == [(0, 5, True), (1, 3, False)]
    children = [c.seq_id for c in forked.children]
    for _ in range(3):
        out, _ = step(sched)
        assert plan_of(out)[:3] == [(0, 1, True), (children[0], 1, True), (children[1], 1, True)]
        assert plan_of(out)[3][0] == 1 and plan_of(out)[3][1] == 5


def test_long_prefill_token_threshold_caps_each_prompt_chunk():
    kv = KVCacheManager(64, 4, enable_caching=False)
    sched = Scheduler(SchedulerLimits(8, 16, 128, long_prefill_token_threshold=6), kv, frozenset({EOS}))
    a, b, c = make_seq(0, 20), make_seq(1, 20, first_token=50), make_seq(2, 3, first_token=90)
    for seq in (a, b, c):
        sched.add(seq)
    out, _ = step(sched)
    assert plan_of(out) == [(0, 6, False), (1, 6, False), (2, 3, True)]
    out, _ = step(sched)
    assert plan_of(out) == [(2, 1, True), (0, 6, False), (1, 6, False)]


def make_priority_scheduler(num_blocks=64, lookahead=1):
    kv = KVCacheManager(num_blocks, 4, enable_caching=True)
    limits = SchedulerLimits(8, 64, 128, admission_lookahead=lookahead, policy="priority")
    return Scheduler(limits, kv, frozenset({EOS}))


def prioritized(seq_id, priority, prompt_len=4, first_token=None, arrival=0.0):
    first = 10 * seq_id + 10 if first_token is None else first_token
    seq = Sequence(seq_id, f"r{seq_id}", list(range(first, first + prompt_len)),
                   SamplingParams(max_tokens=8, temperature=0), arrival, priority=priority)
    return seq


def test_priority_policy_admits_lowest_value_first_then_by_arrival():
    sched = make_priority_scheduler()
    seqs = [prioritized(0, 5, arrival=1.0), prioritized(1, 0, arrival=2.0), prioritized(2, 5, arrival=0.5),
            prioritized(3, -1, arrival=3.0)]
    for seq in seqs:
        sched.add(seq)
    assert [s.seq_id for s in sched.waiting] == [3, 1, 2, 0]
    sched.limits.max_num_seqs = 2
    out, _ = step(sched)
    assert [s.seq.seq_id for s in out.scheduled] == [3, 1]


def test_fcfs_ignores_priority():
    sched = make_scheduler()
    low, high = prioritized(0, 9), prioritized(1, 0)
    sched.add(low)
    sched.add(high)
    assert [s.seq_id for s in sched.waiting] == [0, 1]


def test_priority_preemption_takes_the_lowest_priority_latest_arrival():
    # 7 usable blocks of 4 tokens; three 7-token prompts take 2 blocks each (one left)
    sched = make_priority_scheduler(num_blocks=8)
    seqs = [prioritized(0, 9, 7, arrival=1.0), prioritized(1, 9, 7, arrival=2.0), prioritized(2, 0, 7, arrival=3.0)]
    for seq in seqs:
        sched.add(seq)
    step(sched)
    step(sched)
    out, _ = step(sched)  # every sequence needs a third block: only one is free
    assert [s.seq_id for s in out.preempted] == [1]  # not the latest (2, priority 0), the latest of priority 9
    assert {s.seq.seq_id for s in out.scheduled} == {0, 2}
    assert list(sched.waiting) == [seqs[1]]


def test_a_victim_planned_earlier_in_the_step_is_taken_back_out():
    # decode of 1 (admitted last) is planned before 0's prefill chunk, then preempted for it (fcfs)
    kv = KVCacheManager(6, 4, enable_caching=False)
    sched = Scheduler(SchedulerLimits(8, 8, 64), kv, frozenset({EOS}))
    long, short = make_seq(0, 16, max_tokens=2), make_seq(1, 3, max_tokens=8, first_token=60)
    sched.add(long)
    sched.add(short)
    out, _ = step(sched)
    assert plan_of(out) == [(0, 8, False)]
    sched.limits.max_num_batched_tokens = 4
    out, _ = step(sched)  # long: 4 more tokens (block 3 of 5)
    sched.limits.max_num_batched_tokens = 8
    assert plan_of(out) == [(0, 4, False)]
    out, _ = step(sched)  # long's last 4 tokens, then short admitted
    assert plan_of(out) == [(0, 4, True), (1, 3, True)]
    assert kv.pool.num_free_blocks == 0
    out, _ = step(sched)  # both decode: long needs a 5th block, short fits in its block
    assert [s.seq_id for s in out.preempted] == [1] and plan_of(out) == [(0, 1, True)]
    assert out.num_batched_tokens == 1


def test_update_reads_each_sequences_tokens_by_id_whatever_the_output_order():
    results = []
    for shuffled in (False, True):
        sched = make_scheduler()
        seqs = [make_seq(i, 3 + i, first_token=10 * i + 10) for i in range(3)]
        for seq in seqs:
            sched.add(seq)
        out = sched.schedule()
        by_id = {seq.seq_id: [100 + seq.seq_id] for seq in out.sampled_seqs()}
        sched.update_from_output(out, ModelRunnerOutput.of(dict(reversed(by_id.items())) if shuffled else by_id))
        results.append([seq.output_token_ids for seq in seqs])
    assert results[0] == results[1] == [[100], [101], [102]]


def test_a_stop_string_finishes_a_sequence_and_wins_over_a_stop_token():
    sched = make_scheduler()
    going, stopping = make_seq(0, 3), make_seq(1, 3, first_token=30)
    sched.add(going)
    sched.add(stopping)
    out = sched.schedule()
    finished = sched.update_from_output(out, tokens(out, [5], [EOS]), stopped={1: "stop"})
    assert finished == [stopping] and stopping.stop_reason == "stop" and stopping.output_token_ids == [EOS]
    out = sched.schedule()
    assert sched.update_from_output(out, tokens(out, [6]), stopped={0: "x"}) == [going] and going.stop_reason == "x"
    assert going.finish_reason is FinishReason.STOP and not sched.running
