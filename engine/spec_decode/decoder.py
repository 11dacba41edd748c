"""Speculative decoding inside the engine step: how many drafts to verify (adaptive), proposing them,
and the counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import propose_ngram


@dataclass
class SpecStats:
    draft_tokens: int = 0  # proposed and verified
    accepted_tokens: int = 0
    speculative_steps: int = 0
    accepted_by_position: list[int] = field(default_factory=list)  # accepted drafts at draft position i
    drafted_by_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def snapshot(self) -> dict:
        return {"draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "acceptance_rate": round(self.acceptance_rate, 4), "speculative_steps": self.speculative_steps,
                "acceptance_by_position": [round(a / d, 4) if d else 0.0 for a, d in
                                           zip(self.accepted_by_position, self.drafted_by_position, strict=True)]}


class AdaptiveControl:
    """Speculate only while it pays: few enough decoding sequences that verifying (1 + k) tokens each
    stays cheap (a memory-bound step), and drafts being accepted often enough. While paused for low
    acceptance, one speculative step every `probe_every` steps keeps the estimate fresh."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.acceptance = 1.0  # moving average of the per-step acceptance rate
        self.steps_since_probe = 0

    def lookahead(self, num_decoding: int) -> int:
        if num_decoding == 0:
            return 0
        k = min(self.config.num_speculative_tokens, self.config.max_verify_tokens // num_decoding - 1)
        if k <= 0:
            return 0
        if self.acceptance < self.config.min_acceptance:
            self.steps_since_probe += 1
            if self.steps_since_probe < self.config.probe_every:
                return 0
            self.steps_since_probe = 0
        return k

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.acceptance = 0.7 * self.acceptance + 0.3 * accepted / drafted


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, runner) -> None:
        self.config = config
        self.control = AdaptiveControl(config)
        self.stats = SpecStats(accepted_by_position=[0] * config.num_speculative_tokens,
                               drafted_by_position=[0] * config.num_speculative_tokens)
        self.draft = None
        if config.method in ("draft", "self"):
            from engine.spec_decode.draft import DraftProposer

            self.draft = DraftProposer(config, runner)

    def lookahead(self, running: list[Sequence]) -> int:
        decoding = sum(1 for s in running if s.num_uncomputed_tokens == 1 and s.num_output_tokens > 0)
        return self.control.lookahead(decoding)

    def propose(self, plan: SchedulerOutput) -> None:
        """Fill `spec_token_ids` of the sequences the plan made room for."""
        work = [(s.seq, plan.spec_lookahead[s.seq.seq_id]) for s in plan.scheduled
                if s.seq.seq_id in plan.spec_lookahead]
        if self.draft is not None and work:
            self.draft.propose(work)
        for seq, k in work:
            if self.draft is None:
                seq.spec_token_ids = propose_ngram(seq.token_ids, k, self.config.prompt_lookup_min,
                                                   self.config.prompt_lookup_max)
            plan.spec_drafts[seq.seq_id] = len(seq.spec_token_ids)

    def record(self, plan: SchedulerOutput, new_tokens: dict[int, int]) -> tuple[int, int, list[int]]:
        """new_tokens: seq_id -> tokens appended this step, for the sequences that carried drafts.
        Returns this step's (drafted, accepted, accepted by draft position)."""
        drafted = accepted = 0
        by_position = [0] * self.config.num_speculative_tokens
        for seq_id in plan.spec_lookahead:
            num_drafts = plan.spec_drafts.get(seq_id, 0)
            if not num_drafts:
                continue
            hits = new_tokens.get(seq_id, 1) - 1
            drafted += num_drafts
            accepted += hits
            for position in range(num_drafts):
                self.stats.drafted_by_position[position] += 1
                self.stats.accepted_by_position[position] += position < hits
                by_position[position] += position < hits
        if drafted:
            self.stats.speculative_steps += 1
            self.stats.draft_tokens += drafted
            self.stats.accepted_tokens += accepted
        self.control.record(drafted, accepted)
        return drafted, accepted, by_position
