"""Speculative decoding inside the engine step: how many drafts to verify (adaptive), proposing them,
and the counters."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.cost import StepCost
from engine.spec_decode.ngram import propose_ngram

if TYPE_CHECKING:
    import torch

    from engine.sequence import Sequence
    from engine.spec_decode.draft import DraftSetup
    from engine.step_types import ModelRunnerOutput, SchedulerOutput


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
    """Speculate only while it pays. Each step picks the number of drafts k (0 = none) that maximises
    expected tokens per second, B * E(k) / (cost(B * (1 + k)) + k * B * draft cost), where `cost` is the
    measured cost of a step of that many tokens and the draft cost the measured proposer time per draft.
    Acceptance is modelled as geometric: E(k) = 1 + q * (a + a^2 + ... + a^k), with a the chance a draft is
    accepted once the ones before it were, and q the chance the proposer has drafts at all (an n-gram may
    find no match); both are decayed counts, updated by every speculative step whatever k it used.
    While no k pays, a speculative step every `probe_every` steps keeps the estimates fresh."""

    DECAY = 0.95

    def __init__(self, config: SpeculativeConfig, cost) -> None:
        self.config = config
        self.cost = cost  # tokens -> seconds of a step
        self.accepted, self.tested = 4.0, 5.0  # a hopeful prior: a = 0.8
        self.proposed, self.offered = 1.0, 1.0  # q = 1
        self.draft_seconds = 0.0  # proposer time per draft token and sequence (0 for n-gram lookups)
        self.steps_since_probe = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.tested

    def expected_tokens(self, k: int) -> float:
        a, q = self.acceptance, self.proposed / self.offered
        return 1.0 + q * sum(a ** j for j in range(1, k + 1))

    def lookahead(self, num_decoding: int) -> int:
        if num_decoding == 0:
            return 0
        limit = min(self.config.num_speculative_tokens, self.config.max_verify_tokens // num_decoding - 1)
        if limit <= 0:
            return 0
        best_k, best_rate = 0, num_decoding / self.cost(num_decoding)
        if self.acceptance >= self.config.min_acceptance:
            for k in range(1, limit + 1):
                seconds = self.cost(num_decoding * (1 + k)) + k * num_decoding * self.draft_seconds
                rate = num_decoding * self.expected_tokens(k) / seconds
                if rate > best_rate * 1.03:  # a margin: a tie is not worth the verification
                    best_k, best_rate = k, rate
        if best_k:
            self.steps_since_probe = 0
            return best_k
        self.steps_since_probe += 1
        if self.steps_since_probe >= self.config.probe_every:
            self.steps_since_probe = 0
            return limit
        return 0

    def record(self, offered: int, proposed: int, tested: int, accepted: int) -> None:
        """One step: sequences given room for drafts, those that got some, drafts tested (up to and
        including the first rejection), drafts accepted."""
        if not offered:
            return
        d = self.DECAY
        self.offered, self.proposed = d * self.offered + offered, d * self.proposed + proposed
        self.tested, self.accepted = d * self.tested + tested, d * self.accepted + accepted
        self.tested = max(self.tested, 1e-6)

    def record_proposal(self, seconds: float, draft_tokens: int) -> None:
        if draft_tokens:
            self.draft_seconds += 0.2 * (seconds / draft_tokens - self.draft_seconds)


def draft_key(config: SpeculativeConfig) -> tuple | None:
    """What a draft proposer (its model and KV pool) depends on: decoders with the same key share one."""
    if config.method == "draft":
        return ("draft", config.model)
    if config.method == "self":
        return ("self", config.draft_layers)
    if config.method == "medusa":
        return ("medusa", config.model)
    return None


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, setup: DraftSetup, draft=None) -> None:
        """`draft`: an existing proposer of the same `draft_key` to reuse (its model and KV pool)."""
        self.config = config
        self.cost = StepCost.calibrate(setup.model, config.max_verify_tokens)
        self.control = AdaptiveControl(config, self.cost)
        self.stats = SpecStats(accepted_by_position=[0] * config.num_speculative_tokens,
                               drafted_by_position=[0] * config.num_speculative_tokens)
        self.draft = draft
        if draft is None and config.method in ("draft", "self"):
            from engine.spec_decode.draft import DraftProposer

            self.draft = DraftProposer(config, setup)
        elif draft is None and config.method == "medusa":
            from engine.spec_decode.medusa import MedusaProposer

            self.draft = MedusaProposer(config, setup)

    def lookahead(self, running: list[Sequence]) -> int:
        decoding = sum(1 for s in running if s.num_uncomputed_tokens == 1 and s.num_output_tokens > 0)
        return self.control.lookahead(decoding)

    def propose(self, plan: SchedulerOutput) -> tuple[dict[int, list[int]], dict[int, torch.Tensor]]:
        """Drafts for the sequences the plan made room for: {seq_id: draft tokens}, and {seq_id: the draft
        model's distributions at them} (empty for n-gram lookups)."""
        work = [(s.seq, plan.spec_lookahead[s.seq.seq_id]) for s in plan.scheduled
                if s.seq.seq_id in plan.spec_lookahead]
        if not work:
            return {}, {}
        if self.draft is None:
            return {seq.seq_id: propose_ngram(seq.token_ids, k, self.config.prompt_lookup_min,
                                              self.config.prompt_lookup_max) for seq, k in work}, {}
        started = time.perf_counter()
        drafts = self.draft.propose(work)
        self.control.record_proposal(time.perf_counter() - started, sum(k for _, k in work))
        return drafts

    def observe(self, plan: SchedulerOutput, output: ModelRunnerOutput,
                seconds: float) -> tuple[int, int, list[int]]:
        """After the runner ran `plan` in `seconds`: refine the cost model and count what was accepted (read
        from `output` by id). Returns this step's (drafted, accepted, accepted by draft position)."""
        if hasattr(self.draft, "observe"):  # Medusa heads: the hidden states of this step's last tokens
            self.draft.observe(plan, output)
        if all(s.num_new_tokens == 1 for s in plan.scheduled):  # decode-only steps refine the step cost
            self.cost.observe(len(plan.scheduled) + sum(map(len, plan.spec_token_ids.values())), seconds)
        drafted = accepted = tested = proposed = 0
        by_position = [0] * self.config.num_speculative_tokens
        for seq_id in plan.spec_lookahead:
            num_drafts = len(plan.spec_token_ids.get(seq_id, ()))
            if not num_drafts:
                continue
            hits = len(output.sampled_token_ids.get(seq_id, [0])) - 1
            proposed += 1
            tested += min(hits + 1, num_drafts)
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
        self.control.record(len(plan.spec_lookahead), proposed, tested, accepted)
        return drafted, accepted, by_position
