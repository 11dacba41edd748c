"""Iteration-level scheduling under a token budget: decoding sequences first (forked samples included),
then the chunks of running prefills, then swapped-out sequences back in, then (chunked) prefills of waiting ones.
When blocks run out the most recently admitted sequence (fcfs) or the lowest-priority, latest-arrived one is
preempted: recomputed later, or swapped out to host blocks and back (engine/swap.py; `preemption_mode`).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.block_pool import KVCacheManager
from engine.sampling_params import context_length_error
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.step_types import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from engine.swap import SWAP_MIN_COMPUTED_TOKENS, SwapSpace

if TYPE_CHECKING:
    from engine.kv_connector.base import KVConnector
    from engine.metrics import EngineStats

__all__ = ["Scheduler", "SchedulerLimits", "ScheduledSeq", "SchedulerOutput"]


@dataclass
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    admission_lookahead: int = 1  # waiting requests searched for the longest cached prefix (1: strict FCFS)
    policy: str = "fcfs"  # "fcfs", or "priority": lowest `priority` value first, then arrival
    long_prefill_token_threshold: int = 0  # cap on one prompt's chunk per step (0: only the budget caps it)
    max_loras: int = 0  # distinct LoRA adapters running at once (0: no adapters served)
    preemption_mode: str | None = None  # "recompute", "swap", or None: by the victim's computed tokens


class Scheduler:
    """Owns the waiting queue, the running list and the swapped queue; mutates sequences' block tables and
    counters. `swap`: the host block pool swapped-out sequences go to (none: every preemption recomputes).
    `connector`: the KV connector asked, at admission, for blocks past the local prefix cache (engine/kv_connector/)."""

    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager, eos_token_ids: frozenset[int] = frozenset(),
                 next_seq_id: Callable[[], int] | None = None, swap: SwapSpace | None = None,
                 connector: KVConnector | None = None):
        self.limits = limits
        self.kv = kv
        self.connector = connector
        self.swap = swap or SwapSpace(0)
        self.swapped: deque[Sequence] = deque()  # preempted with their KV in host blocks, served before waiting
        self.eos_token_ids = eos_token_ids
        self.next_seq_id = next_seq_id or itertools.count(1 << 40).__next__
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

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
        if seq.params.n > self.limits.max_num_seqs:
            return f"n ({seq.params.n}) exceeds max_num_seqs ({self.limits.max_num_seqs})"
        return None

    def add(self, seq: Sequence) -> bool:
        """Queue seq; a sequence that can never run is finished with an error instead (returns False)."""
        reason = self.rejection_reason(seq)
        if reason is not None:
            seq.finish(FinishReason.ERROR, reason)
            return False
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)
        return True

    def _enqueue(self, seq: Sequence, front: bool = False, queue: deque[Sequence] | None = None) -> None:
        """fcfs: the back of the queue (the front for a preempted sequence); priority: by (priority, arrival).
        `queue`: the waiting queue unless given."""
        queue = self.waiting if queue is None else queue
        if self.limits.policy == "priority":
            queue.insert(bisect.bisect_right(queue, _priority_key(seq), key=_priority_key), seq)
        elif front:
            queue.appendleft(seq)
        else:
            queue.append(seq)

    def schedule(self, num_spec_tokens: int = 0) -> SchedulerOutput:
        """Plan one step. With `num_spec_tokens`, decoding sequences also get KV slots (and budget) for up
        to that many draft tokens, recorded in `spec_lookahead`; drafts are dropped before anything is
        preempted for them. A waiting sequence that cannot be scheduled even with nothing running is
        finished with an error (in `failed`), so no request can stall the others. Swapped-out sequences come back
        before any waiting one is admitted (as vLLM v0), and none in a step that preempts."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, num_spec_tokens)
        if not out.preempted:
            budget = self._schedule_swapped(out, budget)
        blocked = None if out.preempted or self.swapped else self._schedule_waiting(out, budget)
        if blocked is not None and not out.scheduled and not self.running:
            seq, why = blocked
            self.finish(seq, FinishReason.ERROR)
            seq.error = f"could not be scheduled even with nothing else running: {why}"
            out.failed.append(seq)
        for seq, _, sample in out.scheduled:
            if sample and seq.fork_pending:
                out.forks[seq.seq_id] = [seq.fork(self.next_seq_id(), i) for i in range(1, seq.params.n)]
        out.block_copies = self.kv.take_copies()
        if out.scheduled:  # a step runs: the swap-outs planned so far are copied first (else they wait for one)
            out.blocks_to_swap_out = self.swap.take_swap_outs()
        return out

    def _schedule_running(self, out: SchedulerOutput, num_spec_tokens: int) -> int:
        """Decoding sequences (one token to compute), then the running prefills' chunks; returns the budget left."""
        budget = self.limits.max_num_batched_tokens
        decodes_first = sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1)
        for seq in decodes_first:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted for an earlier one
                continue
            num_new = self._chunk(seq.num_uncomputed_tokens, budget)
            lookahead = self._spec_room(seq, num_spec_tokens, budget - num_new)
            while not self.kv.allocate_slots(seq, num_new + lookahead):
                if lookahead:
                    lookahead = 0
                    continue
                victim = self._victim()
                budget += self._unschedule(out, victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(self._scheduled(seq, num_new))
                if lookahead:
                    out.spec_lookahead[seq.seq_id] = lookahead
                budget -= num_new + lookahead
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> tuple[Sequence, str] | None:
        """Admit waiting sequences while they fit; returns the one that did not, with why."""
        limits = self.limits
        while self.waiting and budget > 0:
            seq, cached = self._next_waiting()
            if not self._adapter_fits(seq):  # its adapter would be one too many: admit the first one that fits
                seq = next((s for s in self.waiting if self._adapter_fits(s)), None)
                if seq is None:
                    return self.waiting[0], f"max_loras ({limits.max_loras}) adapters are running"
                cached = self.kv.find_cached_prefix(seq)
            if len(self.running) + (seq.params.n if seq.fork_pending else 1) > limits.max_num_seqs:
                return seq, f"max_num_seqs ({limits.max_num_seqs}) is reached"
            num_external = 0 if self.connector is None else self.connector.get_num_new_matched_tokens(
                seq, len(cached) * self.kv.block_size)  # tokens the KV connector loads instead of computing
            num_new = seq.num_tokens - len(cached) * self.kv.block_size - num_external
            if num_new > budget and not limits.enable_chunked_prefill:
                return seq, f"{num_new} tokens to prefill exceed the token budget and chunked prefill is off"
            num_new = self._chunk(num_new, budget)
            if not self.kv.can_admit(seq, cached, num_external + num_new, keep_watermark=bool(self.running)):
                return seq, f"its first {num_new} tokens do not fit in the free KV blocks"
            self._take_waiting(seq)
            self.kv.admit(seq, cached)
            if not self.kv.allocate_slots(seq, num_external + num_new):
                raise RuntimeError("admission check and allocation disagree")
            if num_external:  # loaded before the forward, so computed as prefix-cache hits are
                out.kv_loads[seq.seq_id] = self.connector.update_state_after_alloc(seq, num_external)
                seq.num_computed_tokens += num_external
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
        return None

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        """Swap sequences back in, in queue order, while their blocks and next tokens fit; returns the budget left."""
        while self.swapped and budget > 0:
            seq = self.swapped[0]
            if (not self._adapter_fits(seq)
                    or len(self.running) + (seq.params.n if seq.fork_pending else 1) > self.limits.max_num_seqs):
                break
            num_new = self._chunk(seq.num_uncomputed_tokens, budget)
            if not self.swap.can_swap_in(seq, self.kv, num_new, keep_watermark=bool(self.running)):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += self.swap.swap_in(seq, self.kv)
            if not self.kv.allocate_slots(seq, num_new):
                raise RuntimeError("swap-in check and allocation disagree")
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
        return budget

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Can seq run beside the running sequences without more than `max_loras` distinct adapters?"""
        if seq.lora is None:
            return True
        running = {s.lora.digest for s in self.running if s.lora is not None}
        return seq.lora.digest in running or len(running) < self.limits.max_loras

    def _chunk(self, num_uncomputed: int, budget: int) -> int:
        """Tokens of one sequence to compute this step: under the budget and, for a prompt, under
        `long_prefill_token_threshold`, so several prefills share a step and none stalls the rest."""
        num_new = min(num_uncomputed, budget)
        threshold = self.limits.long_prefill_token_threshold
        if self.limits.enable_chunked_prefill and 0 < threshold < num_new:
            num_new = threshold
        return num_new

    def _victim(self) -> Sequence:
        """The running sequence to preempt: the most recently admitted (fcfs), or under "priority" the
        one with the largest priority value, the latest-arrived among those."""
        if self.limits.policy == "priority":
            return max(reversed(self.running), key=lambda s: (s.priority, s.arrival_time))
        return self.running[-1]

    @staticmethod
    def _unschedule(out: SchedulerOutput, seq: Sequence) -> int:
        """Take a sequence already planned in this step back out of the plan; returns the budget it held."""
        for index, planned in enumerate(out.scheduled):
            if planned.seq is seq:
                del out.scheduled[index]
                return planned.num_new_tokens + out.spec_lookahead.pop(seq.seq_id, 0)
        return 0

    def _next_waiting(self) -> tuple[Sequence, list[int]]:
        """The waiting sequence to admit next, with its cached prefix blocks.

        Queue order (first come, first served, or by priority), except that within the first
        `admission_lookahead` waiting requests the one with the longest prefix already in the cache goes
        first: rows sharing a prefix are admitted together while that prefix is resident, instead of being
        interleaved with rows that would evict it. A preempted sequence, or one passed over too often, is
        never overtaken; under "priority" only a request of the head's own priority may overtake it."""
        head = self.waiting[0]
        head_cached = self.kv.find_cached_prefix(head)
        lookahead = self.limits.admission_lookahead
        overtaken_enough = head.admission_skips >= 4 * lookahead
        if lookahead <= 1 or not self.kv.enable_caching or head.num_preemptions or overtaken_enough:
            return head, head_cached
        best, best_cached = head, head_cached
        candidates = itertools.islice(self.waiting, 1, lookahead)
        if self.limits.policy == "priority":
            candidates = itertools.takewhile(lambda s: s.priority == head.priority, candidates)
        for seq in candidates:
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
        """Swap seq out to host blocks and queue it among the swapped (fcfs: at the front), when the preemption mode
        picks swapping and the swap space has room; else drop its KV and send it back to the waiting queue to be
        recomputed (fcfs: its front). A draft model's KV is recomputed either way (its pool is not swapped)."""
        self.running.remove(seq)
        seq.draft_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if self._swaps(seq) and self.swap.swap_out(seq, self.kv):
            seq.status = SequenceStatus.SWAPPED
            self._enqueue(seq, front=True, queue=self.swapped)
            return
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq, front=True)

    def preempt_together(self, seqs: list[Sequence]) -> None:
        """Preempt the running ones of `seqs` between steps and queue them next to each other, so that admission
        meets them in one run (a beam group whose beam was preempted: beams holding blocks while a sibling cannot
        come back would stall)."""
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:
                self._preempt(seq)
        seq_ids = {seq.seq_id for seq in seqs}
        _queue_together(self.waiting, seq_ids)
        _queue_together(self.swapped, seq_ids)

    def _swaps(self, seq: Sequence) -> bool:
        """Is seq swapped rather than recomputed (when the swap space has room)?"""
        mode = self.limits.preemption_mode
        if mode is None:
            return seq.num_computed_tokens >= SWAP_MIN_COMPUTED_TOKENS
        return mode == "swap"

    def update_from_output(self, out: SchedulerOutput, output: ModelRunnerOutput, stopped: dict[int, str] | None = None,
                           forks: dict[int, list[Sequence]] | None = None) -> list[Sequence]:
        """Advance the counters of every scheduled sequence and append each one's new tokens, looked up by id
        in `output` (the accepted drafts, then one sampled token); forked samples join the running list here, the
        plan's and `forks` (a beam picked twice). `stopped`: seq_id -> the stop string its new text reached, which
        finishes it. Returns the sequences that finished; their blocks are freed. Slots taken for drafts that were
        not accepted, or withheld, are released."""
        stopped, forks = stopped or {}, forks or {}
        finished = []
        for seq, num_new, sample in out.scheduled:
            seq.num_computed_tokens += num_new
            if not sample:
                continue
            children = out.forks.get(seq.seq_id, []) + forks.get(seq.seq_id, [])
            if children:
                seq.children = children
            for child in children:
                child.num_computed_tokens = seq.num_computed_tokens
                child.status = SequenceStatus.RUNNING
                self.kv.share_blocks(child)
                self.running.append(child)
            for member in (seq, *children):
                new_tokens = output.tokens_of(member.seq_id)
                member.num_computed_tokens += len(new_tokens) - 1  # accepted drafts were computed too
                if self._append(member, new_tokens, stopped.get(member.seq_id)):
                    finished.append(member)
            if seq.seq_id in out.spec_lookahead and not seq.is_finished:
                self.kv.trim(seq)
        for seq in out.spec_withheld:
            if not seq.is_finished:
                self.kv.trim(seq)
        return finished

    def kept_tokens(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        """The new tokens seq takes (up to the first that finishes it), and why it finishes (None: it goes on)."""
        params = seq.params
        for count, token in enumerate(tokens, start=1):
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
                return tokens[:count], FinishReason.STOP
            if (seq.num_output_tokens + count >= params.max_tokens
                    or seq.num_tokens + count >= self.limits.max_model_len):
                return tokens[:count], FinishReason.LENGTH
        return tokens, None

    def _append(self, seq: Sequence, tokens: list[int], stop_string: str | None) -> bool:
        """Append the tokens seq takes; True when it finished. A stop string in their text finishes it too, and
        wins over a stop token."""
        kept, reason = self.kept_tokens(seq, tokens)
        for token in kept:
            seq.append_token(token)
        if stop_string is not None:
            seq.stop_reason, reason = stop_string, FinishReason.STOP
        elif reason is FinishReason.STOP:
            seq.stop_reason = kept[-1]
        if reason is None:
            return False
        self.finish(seq, reason)
        return True

    def read_gauges(self, stats: EngineStats) -> None:
        """Set `stats`' gauges and counters of what the scheduler holds: queues, KV pool, swap, prefix cache and KV
        connector."""
        kv = self.kv
        stats.num_running, stats.num_waiting = len(self.running), len(self.waiting)
        stats.num_swapped = len(self.swapped)
        stats.kv_cache_usage = kv.pool.usage
        stats.num_preemptions = self.num_preemptions
        stats.kv_blocks_swapped_out = self.swap.stats.blocks_swapped_out
        stats.kv_blocks_swapped_in = self.swap.stats.blocks_swapped_in
        if self.connector is not None:
            moved = self.connector.stats
            stats.kv_connector_blocks_loaded, stats.kv_connector_blocks_saved = moved.blocks_loaded, moved.blocks_saved
            stats.kv_connector_blocks_rejected, stats.kv_connector_store_errors = (moved.blocks_rejected,
                                                                                   moved.store_errors)
        stats.prefix_cache_queries = kv.stats.queries
        stats.prefix_cache_hits = kv.stats.hits

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Finish a waiting, running or swapped sequence and release its blocks (host blocks too)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swap.free(seq)
        self.kv.free(seq)
        if self.connector is not None:
            self.connector.request_finished(seq)
        seq.finish(reason)


def _priority_key(seq: Sequence) -> tuple[int, float, int]:
    return seq.priority, seq.arrival_time, seq.seq_id


def _queue_together(queue: deque[Sequence], seq_ids: set[int]) -> None:
    """Move the queued sequences of `seq_ids` next to the first of them."""
    members = [s for s in queue if s.seq_id in seq_ids]
    if len(members) < 2:
        return
    first = next(i for i, s in enumerate(queue) if s.seq_id in seq_ids)
    rest = [s for s in queue if s.seq_id not in seq_ids]
    queue.clear()
    queue.extend(rest[:first] + members + rest[first:])
