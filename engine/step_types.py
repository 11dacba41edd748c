"""What one engine step hands from part to part, keyed by sequence id (as vLLM v1's `SchedulerOutput` and
`ModelRunnerOutput`): the scheduler's plan, the sampler's row layout and the runner's result. Nothing here is
matched by position."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from engine.outputs import SampleLogprobs
    from engine.sequence import Sequence


class KVLoad(NamedTuple):
    """A block the KV connector loads before the forward: the pool block, its chain hash and its checked bytes (every
    layer's K rows, then every layer's V rows, as the pool holds them)."""

    block_id: int
    block_hash: bytes
    payload: bytes


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_new_tokens: int
    sample: bool  # this chunk reaches the end of the known tokens, so a next token is sampled


@dataclass
class SchedulerOutput:
    """The scheduler's plan for one step, with the drafts the speculative decoder adds to it."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    spec_withheld: list[Sequence] = field(default_factory=list)  # given draft slots but no drafts (`withhold_drafts`)
    forks: dict[int, list[Sequence]] = field(default_factory=dict)  # parent seq_id -> samples 1..n-1
    spec_lookahead: dict[int, int] = field(default_factory=dict)  # seq_id -> draft tokens it has slots for
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> drafts verified this step
    spec_draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> [drafts, vocab], draft models
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, host) blocks, copied first
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host, device), before the forward
    failed: list[Sequence] = field(default_factory=list)  # waiting sequences that could never be scheduled
    kv_loads: dict[int, list[KVLoad]] = field(default_factory=dict)  # seq_id -> blocks the KV connector loads

    def sample_groups(self) -> list[tuple[Sequence, list[Sequence]]]:
        """Each sampled row with the sequences that draw from it (a forking parent feeds n)."""
        return [(s.seq, [s.seq, *self.forks.get(s.seq.seq_id, [])]) for s in self.scheduled if s.sample]

    def sampled_seqs(self) -> list[Sequence]:
        """Every sequence that gets tokens this step."""
        return [seq for _, seqs in self.sample_groups() for seq in seqs]

    def withhold_drafts(self, seqs: list[Sequence]) -> None:
        """No drafts for `seqs` this step (beams advance one token at a time); the scheduler's update releases the
        slots it took for them."""
        for seq in seqs:
            del self.spec_lookahead[seq.seq_id]
            self.spec_withheld.append(seq)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens computed this step that are not a decode's one (prompt chunks, recomputed tokens); read it before
        the update advances the sequences."""
        return sum(s.num_new_tokens for s in self.scheduled
                   if not (s.num_new_tokens == 1 and s.seq.num_computed_tokens >= s.seq.num_prompt_tokens))

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampleLayout:
    """A step's sampled sequences and their logits rows. A forking parent's row feeds its n samples; a
    sequence with drafts has one row per draft and one beyond, at draft position i after drafts[:i]."""

    seqs: dict[int, Sequence] = field(default_factory=dict)  # seq_id -> sequence that gets tokens
    first_row: dict[int, int] = field(default_factory=dict)  # seq_id -> its first logits row
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> drafts it verifies (none: not here)
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    row_sources: list[tuple[int, int]] = field(default_factory=list)  # (seq_id whose batch rows are read, samples)

    @classmethod
    def of(cls, plan: SchedulerOutput) -> SampleLayout:
        layout = cls(draft_probs=plan.spec_draft_probs)
        row = 0
        for row_seq, seqs in plan.sample_groups():
            layout.row_sources.append((row_seq.seq_id, len(seqs)))
            drafts = plan.spec_token_ids.get(row_seq.seq_id)
            if drafts:
                layout.drafts[row_seq.seq_id] = drafts
                seqs = [row_seq]
            for seq in seqs:
                layout.seqs[seq.seq_id] = seq
                layout.first_row[seq.seq_id] = row
                row += 1 + len(drafts or ())
        return layout

    @property
    def plain(self) -> list[int]:
        """Ids of the sequences sampled from one row."""
        return [i for i in self.seqs if i not in self.drafts]

    def row_contexts(self) -> list[tuple[int, Sequence, list[int]]]:
        """(logits row, sequence, drafts before that row) for every row; the drafts count as generated there."""
        return [(self.first_row[i] + position, seq, self.drafts.get(i, [])[:position])
                for i, seq in self.seqs.items() for position in range(1 + len(self.drafts.get(i, ())))]

    def batch_rows(self, rows: dict) -> list[int]:
        """The flat-batch rows (`rows`: seq_id -> batch.Rows) whose hidden states become logits, in logits order."""
        out: list[int] = []
        for seq_id, num_samples in self.row_sources:
            r = rows[seq_id]
            if seq_id in self.drafts:
                out.extend(range(r.first, r.first + r.count))
            else:
                out.extend([r.last] * num_samples)
        return out


class SeqBlocks(NamedTuple):
    """What the model needs of a sequence: its id and block table (sent to the other tensor-parallel ranks)."""

    seq_id: int
    block_table: list[int]


class StepInput(NamedTuple):
    """What the model runs in one step: copy-on-write block copies, each sequence's tokens this step
    (`batch.BatchItem`s), the flat-batch rows whose logits are sampled, and the blocks swapped out to and in from
    the host (`SchedulerOutput`'s pairs), and the KV connector's loads."""

    block_copies: list[tuple[int, int]]
    items: list
    sample_rows: list[int]
    blocks_to_swap_out: list[tuple[int, int]] = []
    blocks_to_swap_in: list[tuple[int, int]] = []
    kv_loads: dict[int, list[KVLoad]] = {}  # seq_id -> blocks loaded by the KV connector, after the swaps

    def for_ranks(self) -> StepInput:
        """This step as plain data, the sequences reduced to their ids and block tables."""
        return self._replace(items=[item.__class__(SeqBlocks(item.seq.seq_id, item.seq.block_table), item.start,
                                                   item.token_ids) for item in self.items])


@dataclass
class SamplerOutput:
    """Per sequence id: the accepted drafts then one sampled token, and the logprobs of those tokens when asked."""

    sampled_token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, SampleLogprobs] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    """One step's result by sequence id (vLLM v1's `ModelRunnerOutput`); `seq_ids` lists who got tokens.
    `sample_hidden`: the final hidden states at the logits rows (`SampleLayout`'s rows), which Medusa heads read."""

    seq_ids: list[int] = field(default_factory=list)
    sampled_token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, SampleLogprobs] = field(default_factory=dict)
    sample_hidden: torch.Tensor | None = None

    @classmethod
    def of(cls, sampled: SamplerOutput | dict[int, list[int]],
           sample_hidden: torch.Tensor | None = None) -> ModelRunnerOutput:
        if isinstance(sampled, dict):
            sampled = SamplerOutput(sampled)
        return cls(list(sampled.sampled_token_ids), sampled.sampled_token_ids, sampled.logprobs, sample_hidden)

    def tokens_of(self, seq_id: int) -> list[int]:
        return self.sampled_token_ids[seq_id]

    def edited(self, edits: StepEdits) -> ModelRunnerOutput:
        """This output as the step's hooks decided (a new one: this one is left as the runner made it)."""
        if not (edits.tokens or edits.drop_logprobs):
            return self
        return ModelRunnerOutput(self.seq_ids, {**self.sampled_token_ids, **edits.tokens},
                                 {i: lp for i, lp in self.logprobs.items() if i not in edits.drop_logprobs},
                                 self.sample_hidden)

    @property
    def num_tokens(self) -> int:
        return sum(map(len, self.sampled_token_ids.values()))


@dataclass
class StepEdits:
    """What the step's hooks (engine/step_hooks.py) decide after the runner, applied by the step in one place: `tokens`
    replace sequences' sampled ones ([]: the sequence gives its token back), `forks` (parent seq_id -> new sequences)
    join the running ones at the scheduler's update beside the plan's, and the logprobs of `drop_logprobs` are not
    kept. Beam search picks each beam's token this way."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    forks: dict[int, list[Sequence]] = field(default_factory=dict)
    drop_logprobs: set[int] = field(default_factory=set)

    @classmethod
    def merge(cls, edits: Iterable[StepEdits | None]) -> StepEdits:
        merged = cls()
        for edit in edits:
            if edit is not None:
                merged.tokens.update(edit.tokens)
                for parent, children in edit.forks.items():
                    merged.forks.setdefault(parent, []).extend(children)
                merged.drop_logprobs |= edit.drop_logprobs
        return merged
