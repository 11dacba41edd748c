"""Iteration-level scheduling: running sequences first, then (chunked) prefills of waiting ones,
under a token budget; recompute preemption of the most recently admitted sequence when blocks run out.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.block_pool import KVCacheManager
from engine.sampling_params import context_length_error
from engine.sequence import FinishReason, Sequence, SequenceStatus


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_new_tokens: int
    sample: bool  # this chunk reaches the end of the known tokens, so a next token is sampled


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    forks: dict[int, list[Sequence]] = field(default_factory=dict)  # parent seq_id -> samples 1..n-1
    spec_lookahead: dict[int, int] = field(default_factory=dict)  # seq_id -> draft tokens it has slots for
    spec_drafts: dict[int, int] = field(default_factory=dict)  # seq_id -> drafts actually proposed
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks

    def sample_groups(self) -> list[tuple[Sequence, list[Sequence]]]:
        """Each sampled row with the sequences that draw from it, in order (a forking parent feeds n)."""
        return [(s.seq, [s.seq, *self.forks.get(s.seq.seq_id, [])]) for s in self.scheduled if s.sample]

    @property
    def num_samples(self) -> int:
        return sum(len(seqs) for _, seqs in self.sample_groups())

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    admission_lookahead: int = 1  # waiting requests searched for the longest cached prefix (1: strict FCFS)


class Scheduler:
    """Owns the waiting queue and the running list; mutates sequences' block tables and counters."""

    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager, eos_token_ids: frozenset[int] = frozenset(),
                 next_seq_id: Callable[[], int] | None = None):
        self.limits = limits
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.next_seq_id = next_seq_id or itertools.count(1 << 40).__next__
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def rejection_reason(self, seq: Sequence) -> str | None:
        """Why seq can never run here, or None when it can."""
        prompt_len, max_tokens = seq.num_prompt_tokens, seq.params.max_tokens
        if prompt_len == 0:
            return "the prompt is empty"
        if too_long := context_length_error(prompt_len, max_tokens, self.limits.max_model_len):
            return too_long
        needed = self.kv.blocks_needed(prompt_len + max_tokens)
        if needed > self.kv.usable_blocks:
            return f"needs {needed} KV blocks but the pool has only {self.kv.usable_blocks}"
        if not self.limits.enable_chunked_prefill and prompt_len > self.limits.max_num_batched_tokens:
            return (f"prompt ({prompt_len} tokens) exceeds max_num_batched_tokens "
                    f"({self.limits.max_num_batched_tokens}) and chunked prefill is off")
        return None

    def add(self, seq: Sequence) -> bool:
        """Queue seq; a sequence that can never run is finished with an error instead (returns False)."""
        reason = self.rejection_reason(seq)
        if reason is not None:
            seq.finish(FinishReason.ERROR, reason)
            return False
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        return True

    def schedule(self, num_spec_tokens: int = 0) -> SchedulerOutput:
        """Plan one step. With `num_spec_tokens`, decoding sequences also get KV slots (and budget) for up
        to that many draft tokens, recorded in `spec_lookahead`; drafts are dropped before anything is
        preempted for them."""
        out = SchedulerOutput()
        budget = self.limits.max_num_batched_tokens
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            lookahead = self._spec_room(seq, num_spec_tokens, budget - num_new)
            while not self.kv.allocate_slots(seq, num_new + lookahead):
                if lookahead:
                    lookahead = 0
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(self._scheduled(seq, num_new))
                if lookahead:
                    out.spec_lookahead[seq.seq_id] = lookahead
                budget -= num_new + lookahead
                index += 1

        while self.waiting and budget > 0 and not out.preempted:
            seq, cached = self._next_waiting()
            if len(self.running) + (seq.params.n if seq.fork_pending else 1) > self.limits.max_num_seqs:
                break
            num_new = seq.num_tokens - len(cached) * self.kv.block_size
            if num_new > budget and not self.limits.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self.kv.can_admit(seq, cached, num_new):
                break
            self._take_waiting(seq)
            self.kv.admit(seq, cached)
            if not self.kv.allocate_slots(seq, num_new):
                raise RuntimeError("admission check and allocation disagree")
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
        for seq, _, sample in out.scheduled:
            if sample and seq.fork_pending:
                out.forks[seq.seq_id] = [seq.fork(self.next_seq_id(), i) for i in range(1, seq.params.n)]
        out.block_copies = self.kv.take_copies()
        return out

    def _next_waiting(self) -> tuple[Sequence, list[int]]:
        """The waiting sequence to admit next, with its cached prefix blocks.

        First come, first served, except that within the first `admission_lookahead` waiting requests
        the one with the longest prefix already in the cache goes first: rows sharing a prefix are
        admitted together while that prefix is resident, instead of being interleaved with rows that
        would evict it. A preempted sequence, or one passed over too often, is never overtaken."""
        head = self.waiting[0]
        head_cached = self.kv.find_cached_prefix(head)
        lookahead = self.limits.admission_lookahead
        overtaken_enough = head.admission_skips >= 4 * lookahead
        if lookahead <= 1 or not self.kv.enable_caching or head.num_preemptions or overtaken_enough:
            return head, head_cached
        best, best_cached = head, head_cached
        for seq in itertools.islice(self.waiting, 1, lookahead):
            cached = self.kv.find_cached_prefix(seq)
            if len(cached) > len(best_cached):
                best, best_cached = seq, cached
        return best, best_cached

    def _take_waiting(self, seq: Sequence) -> None:
        if self.waiting[0] is seq:
            self.waiting.popleft()
            return
        self.waiting[0].admission_skips += 1
        self.waiting.remove(seq)

    def _spec_room(self, seq: Sequence, wanted: int, budget: int) -> int:
        """Draft tokens a decoding sequence can verify this step (0 for prefills and forks)."""
        if not wanted or seq.num_uncomputed_tokens != 1 or seq.num_output_tokens == 0 or seq.fork_pending:
            return 0
        left = min(seq.params.max_tokens - seq.num_output_tokens, self.limits.max_model_len - seq.num_tokens)
        return max(min(wanted, budget, left - 1), 0)

    @staticmethod
    def _scheduled(seq: Sequence, num_new: int) -> ScheduledSeq:
        return ScheduledSeq(seq, num_new, seq.num_computed_tokens + num_new == seq.num_tokens)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop seq's KV and send it to the front of the waiting queue."""
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_computed_tokens = 0
        seq.spec_token_ids, seq.spec_draft_probs = [], None
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(self, out: SchedulerOutput, sampled: list[list[int]]) -> list[Sequence]:
        """Advance the counters of every scheduled sequence and append the new tokens (one list per
        sequence of `out.sample_groups()`, in order: the accepted drafts, then one sampled token);
        forked samples join the running list here. Returns the sequences that finished; their blocks
        are freed. Slots taken for drafts that were not accepted are released."""
        token_lists = iter(sampled)
        finished = []
        for seq, num_new, sample in out.scheduled:
            seq.num_computed_tokens += num_new
            if not sample:
                continue
            children = out.forks.get(seq.seq_id, [])
            if children:
                seq.children = children
            for child in children:
                child.num_computed_tokens = seq.num_computed_tokens
                child.status = SequenceStatus.RUNNING
                self.kv.share_blocks(child)
                self.running.append(child)
            for member in (seq, *children):
                new_tokens = next(token_lists)
                member.num_computed_tokens += len(new_tokens) - 1  # accepted drafts were computed too
                if self._append(member, new_tokens):
                    finished.append(member)
            if seq.seq_id in out.spec_lookahead:
                seq.spec_token_ids, seq.spec_draft_probs = [], None
                if not seq.is_finished:
                    self.kv.trim(seq)
        return finished

    def _append(self, seq: Sequence, tokens: list[int]) -> bool:
        """Append tokens up to the first that finishes seq; True when it finished."""
        for token in tokens:
            seq.append_token(token)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                return True
        return False

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            seq.stop_reason = token
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.limits.max_model_len:
            return FinishReason.LENGTH
        return None

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a waiting or running sequence and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.finish(reason)
