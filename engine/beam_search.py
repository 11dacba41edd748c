"""Beam search as Hugging Face's `generate(num_beams=W, early_stopping=True)` runs it, over the engine's paged KV.

A beam group is one request. Its live beams are `Sequence`s that decode in lockstep; each step the sampler gives
every beam's top-K log-probabilities (K = max(2, 1 + #EOS) * W, as HF) and `BeamCoordinator` picks the next W beams
among all beams' candidates. A parent picked once goes on with its new token, one picked k > 1 times forks k - 1
children that share its KV blocks (copy-on-write of the partial last block on the next write), and one not picked
is freed. A group advances only in a step that sampled all of its live beams: a beam sampled alone (a sibling was
preempted, or is still prefilling after it) gives its token back and recomputes its last position next step.
Finished hypotheses are kept as HF's beam scorer keeps them: score = cum_logprob / length ** length_penalty, the
best W, the request done once it holds W of them or at max_tokens.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput, SampleLogprobs
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence
from engine.step_hooks import StepHook
from engine.step_types import StepEdits

if TYPE_CHECKING:
    from engine.block_pool import KVCacheManager
    from engine.output_processor import OutputProcessor
    from engine.scheduler import Scheduler
    from engine.step_types import ModelRunnerOutput, SchedulerOutput

MAX_BEAM_WIDTH = 64


@dataclass
class BeamSearchParams:
    """vLLM's `BeamSearchParams`: deterministic beam search of `beam_width` beams for up to `max_tokens` tokens."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # only 0: beams are chosen by log-probability, nothing is sampled
    length_penalty: float = 1.0  # a finished beam scores cum_logprob / length ** length_penalty

    def __post_init__(self) -> None:
        checks = [
            (_is_int(self.beam_width) and 1 <= self.beam_width <= MAX_BEAM_WIDTH,
             f"beam_width must be an integer in [1, {MAX_BEAM_WIDTH}], got {self.beam_width!r}"),
            (_is_int(self.max_tokens) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.temperature == 0, f"beam search is deterministic: temperature must be 0, got {self.temperature!r}"),
            (isinstance(self.length_penalty, int | float) and not isinstance(self.length_penalty, bool),
             f"length_penalty must be a number, got {self.length_penalty!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def num_candidates(self, num_eos: int) -> int:
        """Candidates kept per step (HF's beams_to_keep): enough that W of them do not end in EOS."""
        return max(2, 1 + (0 if self.ignore_eos else num_eos)) * self.beam_width

    def sampling_params(self, num_eos: int) -> SamplingParams:
        """What each beam's sequence runs with: greedy rows with their top-K logprobs, n = W so that admission
        counts the group's W sequences (the prompt's row forks them); EOS and max_tokens are the coordinator's."""
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True, n=self.beam_width,
                                logprobs=0)
        params.logprobs = self.num_candidates(num_eos)  # may exceed the API's limit of 20: set after validation
        return params


@dataclass
class BeamSearchSequence:
    """One returned beam, as vLLM's: `tokens` holds the prompt and the generated tokens, `text` the generated text."""

    tokens: list[int]
    logprobs: SampleLogprobs
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | None = None  # the EOS token that ended it


@dataclass
class BeamSearchOutput:
    """One prompt's beams, best first."""

    sequences: list[BeamSearchSequence]


class Candidate(NamedTuple):
    cum_logprob: float
    beam: int  # index of its parent among the live beams
    token: int


class Hypothesis(NamedTuple):
    score: float
    token_ids: list[int]
    cum_logprob: float
    logprobs: SampleLogprobs
    finish_reason: FinishReason


class Selection(NamedTuple):
    """One step's outcome: the next live beams (W candidates, best first; empty when the search is done)."""

    next_beams: list[Candidate]
    done: bool


def f32(value: float) -> float:
    """Round to float32: HF adds and divides scores in float32, and near-ties must break the same way."""
    return struct.unpack("f", struct.pack("f", value))[0]


def top_candidates(beams: list[tuple[float, dict[int, float]]], count: int) -> list[Candidate]:
    """The `count` best (cum_logprob + logprob) over every beam's top tokens, best first. `beams`: each live beam's
    cum_logprob and {token: logprob} of its `count` most likely tokens (the overall best are among those)."""
    candidates = [Candidate(f32(cum + logprob), index, token)
                  for index, (cum, logprobs) in enumerate(beams) for token, logprob in logprobs.items()]
    candidates.sort(key=lambda c: (-c.cum_logprob, c.beam, c.token))  # ties: the lower flat index, as topk
    return candidates[:count]


@dataclass
class BeamSearchState:
    """The search of one prompt, without sequences: live beams' scores in, next beams and hypotheses out."""

    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    hypotheses: list[Hypothesis] = field(default_factory=list)  # best first, at most W

    def step(self, beams: list[tuple[float, dict[int, float]]], num_generated: int,
             outputs: Callable[[int], tuple[list[int], SampleLogprobs]]) -> Selection:
        """Advance the live beams (cum_logprob, {token: logprob}), each `num_generated` tokens long. `outputs(b)`:
        beam b's tokens and logprobs so far, copied into a hypothesis that it ends."""
        params, width = self.params, self.params.beam_width
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        candidates = top_candidates(beams, params.num_candidates(len(eos)))
        length = num_generated + 1
        last = length >= params.max_tokens
        full = len(self.hypotheses) >= width
        if not full:
            divisor = f32(length ** params.length_penalty)
            for candidate in candidates[:width]:  # only the top W may end; the rest are spares
                if last or candidate.token in eos:
                    tokens, logprobs = outputs(candidate.beam)
                    reason = FinishReason.STOP if candidate.token in eos else FinishReason.LENGTH
                    self.hypotheses.append(Hypothesis(f32(candidate.cum_logprob / divisor), [*tokens, candidate.token],
                                                      candidate.cum_logprob, logprobs, reason))
            self.hypotheses.sort(key=lambda h: -h.score)
            del self.hypotheses[width:]
        if last or len(self.hypotheses) >= width:
            return Selection([], True)
        return Selection([c for c in candidates if c.token not in eos][:width], False)


@dataclass
class Beam:
    seq: Sequence
    cum_logprob: float = 0.0
    logprobs: SampleLogprobs = field(default_factory=list)


@dataclass
class BeamGroup:
    request_id: str
    first: Sequence  # the prompt's sequence: arrival time and metrics
    search: BeamSearchState
    beams: list[Beam]
    next_sample_index: int = 0


class BeamCoordinator(StepHook):
    """The engine's beam groups by request id, a hook of its step (engine/step_hooks.py). Each step `select` (after
    the runner) picks the beams' tokens and forks, handed to the scheduler's update as `StepEdits`; `settle` (after
    the update) frees the beams not chosen and returns the outputs of finished groups."""

    def __init__(self, eos_token_ids: frozenset[int], next_seq_id: Callable[[], int], scheduler: Scheduler,
                 outputs: OutputProcessor, tokenizer) -> None:
        self.eos_token_ids = eos_token_ids
        self.next_seq_id = next_seq_id
        self.scheduler, self.outputs, self.tokenizer = scheduler, outputs, tokenizer
        self.groups: dict[str, BeamGroup] = {}
        self.by_seq: dict[int, BeamGroup] = {}  # live beam seq_id -> its group
        self._dropped: list[Sequence] = []  # beams to free after the update
        self._done: list[BeamGroup] = []

    def add(self, request_id: str, seq: Sequence, params: BeamSearchParams) -> None:
        group = BeamGroup(request_id, seq, BeamSearchState(params, self.eos_token_ids), [Beam(seq)],
                          next_sample_index=params.beam_width)
        self.groups[request_id] = group
        self.by_seq[seq.seq_id] = group

    def drop(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        for beam in group.beams if group is not None else []:
            self.by_seq.pop(beam.seq.seq_id, None)

    def is_beam(self, seq: Sequence) -> bool:
        return seq.seq_id in self.by_seq

    def scheduled(self, plan: SchedulerOutput) -> None:
        """Forget the groups whose request failed; take the beams out of speculative decoding this step (they
        advance one token at a time)."""
        if plan.failed:
            self.settle_lost()
        plan.withhold_drafts([s.seq for s in plan.scheduled
                              if s.seq.seq_id in plan.spec_lookahead and self.is_beam(s.seq)])

    def after_execute(self, plan: SchedulerOutput, output: ModelRunnerOutput, started: float) -> StepEdits | None:
        return self.select(plan, output) if self.groups else None

    def after_update(self, plan: SchedulerOutput) -> list[RequestOutput]:
        return self.settle(plan) if self.groups else []

    def select(self, plan: SchedulerOutput, output: ModelRunnerOutput) -> StepEdits:
        """The beams' tokens (and forks) in place of what was sampled for them; their logprobs are the search's."""
        edits = StepEdits()
        sampled = {s.seq.seq_id for s in plan.scheduled if s.sample}
        groups = {id(g): g for i in sampled if (g := self.by_seq.get(i)) is not None}
        for group in groups.values():
            live = [b.seq.seq_id for b in group.beams]
            if all(i in sampled for i in live):
                self._advance(group, plan, output, edits)
            else:  # not in lockstep this step: the sampled beams give their token back and recompute it
                for seq_id in live:
                    if seq_id in sampled:
                        edits.tokens[seq_id] = []
            edits.drop_logprobs.update(live + [c.seq_id for c in plan.forks.get(group.first.seq_id, [])])
        return edits

    def _advance(self, group: BeamGroup, plan: SchedulerOutput, output: ModelRunnerOutput, edits: StepEdits) -> None:
        beams = group.beams
        rows = [{token: lp.logprob for token, lp in output.logprobs[b.seq.seq_id][-1].items()} for b in beams]
        outputs = lambda i: (beams[i].seq.output_token_ids, beams[i].logprobs + [self._entry(output, beams[i])])
        selection = group.search.step([(b.cum_logprob, row) for b, row in zip(beams, rows, strict=True)],
                                      beams[0].seq.num_output_tokens, outputs)
        forks = plan.forks.get(group.first.seq_id, []) if len(beams) == 1 else []  # the prompt's row made W - 1
        spare = iter(forks)
        next_beams: list[Beam] = []
        taken: set[int] = set()
        for candidate in selection.next_beams:
            parent = beams[candidate.beam]
            if candidate.beam not in taken:
                taken.add(candidate.beam)
                seq = parent.seq
            elif (seq := next(spare, None)) is None:
                seq = parent.seq.fork(self.next_seq_id(), group.next_sample_index)
                group.next_sample_index += 1
                edits.forks.setdefault(parent.seq.seq_id, []).append(seq)
            edits.tokens[seq.seq_id] = [candidate.token]
            entry = self._entry(output, parent)
            next_beams.append(Beam(seq, candidate.cum_logprob, parent.logprobs + [entry]))
        for seq in spare:  # the search ended at the first step: the prompt's forks are not needed
            edits.tokens[seq.seq_id] = []
            self._dropped.append(seq)
        for index, beam in enumerate(beams):
            self.by_seq.pop(beam.seq.seq_id, None)
            if index not in taken:
                edits.tokens[beam.seq.seq_id] = []
                self._dropped.append(beam.seq)
        group.beams = next_beams
        for beam in next_beams:
            self.by_seq[beam.seq.seq_id] = group
        if selection.done:
            self._done.append(group)

    @staticmethod
    def _entry(output: ModelRunnerOutput, beam: Beam) -> dict[int, Logprob]:
        return output.logprobs[beam.seq.seq_id][-1]

    def settle(self, plan: SchedulerOutput) -> list[RequestOutput]:
        """After the scheduler's update: free the beams not chosen, sync each request's sequences with its live
        beams, and finish the groups whose search ended. A group one of whose beams the step preempted is preempted
        whole and queued in one run (`Scheduler.preempt_together`), so that it is admitted again together."""
        scheduler, outputs, tokenizer = self.scheduler, self.outputs, self.tokenizer
        preempted = {seq.seq_id for seq in plan.preempted}
        for seq in self._dropped:
            if not seq.is_finished:
                scheduler.finish(seq, FinishReason.ABORT)
        self._dropped = []
        for group in self.groups.values():
            request = outputs.requests.get(group.request_id)
            if request is not None:
                request.seqs = [b.seq for b in group.beams] or [group.first]
            if any(b.seq.seq_id in preempted for b in group.beams):  # the group waits and comes back together
                scheduler.preempt_together([b.seq for b in group.beams])
        done, self._done = self._done, []
        finished = []
        for group in done:
            for beam in group.beams:
                if not beam.seq.is_finished:
                    scheduler.finish(beam.seq, FinishReason.ABORT)
            self.drop(group.request_id)
            request = outputs.drop(group.request_id)
            outputs.stats.num_requests_finished += 1
            finished.append(group_output(group, request.prompt if request is not None else None, tokenizer))
        return finished

    def settle_lost(self) -> None:
        """Forget the groups whose request left the engine another way (failed, aborted)."""
        for request_id in [r for r in self.groups if r not in self.outputs.requests]:
            self.drop(request_id)


def group_output(group: BeamGroup, prompt: str | None, tokenizer) -> RequestOutput:
    first = group.first
    completions = []
    for index, hyp in enumerate(group.search.hypotheses):
        text = tokenizer.decode(hyp.token_ids, skip_special_tokens=True)
        stop_reason = hyp.token_ids[-1] if hyp.finish_reason is FinishReason.STOP else None
        completions.append(CompletionOutput(index, text, hyp.token_ids, hyp.finish_reason.value, stop_reason,
                                            hyp.logprobs, hyp.cum_logprob))
    return RequestOutput(request_id=group.request_id, prompt=prompt, prompt_token_ids=first.prompt_token_ids,
                         outputs=completions, finished=True, num_cached_tokens=max(first.num_cached_tokens, 0),
                         metrics=RequestMetrics(first.arrival_time, first.first_token_time, time.monotonic(),
                                                first.num_preemptions))


def beam_search_output(request: RequestOutput) -> BeamSearchOutput:
    """vLLM's shape of a beam request's output: each beam's prompt + generated tokens, best first."""
    if request.error:
        raise ValueError(f"beam search of request {request.request_id} failed: {request.error}")
    return BeamSearchOutput([BeamSearchSequence(request.prompt_token_ids + c.token_ids, c.logprobs or [],
                                                c.cumulative_logprob or 0.0, c.text, c.finish_reason, c.stop_reason)
                             for c in request.outputs])


def beam_rejection(prompt_len: int, params: BeamSearchParams, kv: KVCacheManager) -> str | None:
    """Why a beam group can never run in the KV pool: all of its beams must fit at once. They share the prompt's
    blocks, and after a recompute preemption find them again in the prefix cache; without the cache each beam
    recomputes its whole sequence into blocks of its own."""
    width, blocks_of = params.beam_width, kv.blocks_needed
    if kv.enable_caching:
        blocks = blocks_of(prompt_len) + width * (blocks_of(params.max_tokens) + 1)
    else:
        blocks = width * blocks_of(prompt_len + params.max_tokens)
    blocks += kv.watermark_blocks
    if blocks > kv.usable_blocks:
        return (f"beam search of width {params.beam_width} needs up to {blocks} KV blocks but the pool has "
                f"{kv.usable_blocks}")
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


