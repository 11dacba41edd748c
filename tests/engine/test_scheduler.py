"""Scheduler on hand-made cases: chunk sizes, decode-first order, admission limits, preemption order."""

from engine.block_pool import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerLimits
from engine.sequence import FinishReason, Sequence, SequenceStatus

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=128, caching=False):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(SchedulerLimits(max_num_seqs, budget, max_model_len), kv, frozenset({EOS}))


def make_seq(seq_id, prompt_len, max_tokens=8, first_token=10):
    prompt = list(range(first_token, first_token + prompt_len))
    return Sequence(seq_id, f"r{seq_id}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0))


def plan_of(out):
    return [(s.seq.seq_id, s.num_new_tokens, s.sample) for s in out.scheduled]


def step(sched, token=5):
    out = sched.schedule()
    finished = sched.update(out, [[token]] * sum(1 for s in out.scheduled if s.sample))
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
    finished = sched.update(out, [[EOS], [7], [5]])
    assert [s.finish_reason for s in finished] == [FinishReason.STOP, FinishReason.STOP, FinishReason.LENGTH]
    assert eos_seq.stop_reason == EOS and stop_seq.stop_reason == 7
    assert sched.kv.pool.num_free_blocks == sched.kv.usable_blocks and not sched.running


def test_ignore_eos_keeps_going():
    sched = make_scheduler()
    seq = Sequence(0, "r0", [20, 21], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add(seq)
    for _ in range(3):
        out = sched.schedule()
        sched.update(out, [[EOS]])
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
    sched.update(out, [[5]])
    out = sched.schedule(num_spec_tokens=3)
    assert out.spec_lookahead == {0: 3} and len(seq.block_table) == 2  # positions 4..7
    seq.spec_token_ids = [6, 7, 8]
    sched.update(out, [[6, 9]])  # one draft accepted, then a recovered token
    assert seq.output_token_ids == [5, 6, 9] and seq.num_computed_tokens == 6 and seq.spec_token_ids == []
    assert len(seq.block_table) == 2
    out = sched.schedule(num_spec_tokens=3)  # positions 6..9: a third block for the drafts
    assert out.spec_lookahead == {0: 3} and len(seq.block_table) == 3
    sched.update(out, [[1]])  # every draft rejected: the third block goes back
    assert len(seq.block_table) == 2 and sched.kv.pool.num_free_blocks == sched.kv.usable_blocks - 2


def test_drafts_stop_at_max_tokens_and_at_a_finishing_token():
    sched = make_scheduler(block_size=4)
    seq = make_seq(0, 4, max_tokens=3)
    sched.add(seq)
    sched.update(sched.schedule(), [[5]])
    out = sched.schedule(num_spec_tokens=8)
    assert out.spec_lookahead == {0: 1}  # room for 2 more tokens: 1 draft + 1 sampled
    finished = sched.update(out, [[EOS, 7]])
    assert finished == [seq] and seq.output_token_ids == [5, EOS] and seq.finish_reason is FinishReason.STOP
