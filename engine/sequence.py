"""The per-request state object that moves through scheduler, block manager and runner: tokens, counters,
blocks and finish state. What a step or a component keeps beside it (drafts, grammar matchers, seeded streams,
logprobs) lives there, by seq_id."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.lora.adapter import LoRAAdapter


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV in host blocks (engine/swap.py); resumes without recomputing
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"
    ERROR = "error"  # the request could never run (too long for the context or the KV pool)


@dataclass(eq=False)
class Sequence:
    """One generated continuation of a prompt.

    Invariant: `num_computed_tokens` catches up to `len(token_ids)`. Prefill, chunked prefill,
    prefix-cache hits and recompute after preemption all just move that counter.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    host_block_table: list[int] = field(default_factory=list)  # its KV blocks in the swap space while SWAPPED
    priority: int = 0  # lower runs first under the "priority" scheduling policy
    cache_salt: str | None = None  # prefix-cache blocks are shared only between requests with the same salt
    lora: LoRAAdapter | None = None  # the adapter it runs with (engine/lora/); None: the base model
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of the full blocks, in order
    num_registered_blocks: int = 0  # leading blocks of block_table entered in the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_cached_tokens: int = -1  # prefix-cache hit length at first admission; -1 until admitted
    num_preemptions: int = 0
    admission_skips: int = 0  # times a later request with a longer cached prefix was admitted first
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that finished it
    draft_computed_tokens: int = 0  # tokens whose KV the draft model holds (draft proposers only)
    sample_index: int = 0  # which of the request's n samples this is
    children: list[Sequence] = field(default_factory=list)  # samples 1..n-1, forked after the prefill

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def fork_pending(self) -> bool:
        """The first sample of an n > 1 request, not yet forked: its next sampled row feeds all n."""
        return self.params.n > 1 and self.sample_index == 0 and not self.children

    @property
    def sample_seed(self) -> int | None:
        """Seed of this sample's own random stream (distinct per sample of a seeded request)."""
        seed = self.params.seed
        if seed is None or self.sample_index == 0:
            return seed
        return (seed * 0x9E3779B1 + self.sample_index * 0x85EBCA77) % (1 << 63)

    def fork(self, seq_id: int, sample_index: int) -> Sequence:
        """A new sample sharing this sequence's tokens and KV blocks (the caller takes the block references)."""
        child = Sequence(seq_id, self.request_id, self.prompt_token_ids, self.params, self.arrival_time,
                         priority=self.priority, cache_salt=self.cache_salt, lora=self.lora)
        child.sample_index = sample_index
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_table = list(self.block_table)
        child.block_hashes = list(self.block_hashes)
        child.num_registered_blocks = self.num_registered_blocks
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        return child

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = time.monotonic()
