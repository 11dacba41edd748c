"""Results handed back to callers, shaped like vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's log probability under the model (before masks and temperature), as in vLLM."""

    logprob: float
    rank: int  # 1 is the most likely token
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # per output token: the sampled token and the top-k


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"; None while running
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: SampleLogprobs | None = None  # with SamplingParams(logprobs=k)
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """One input's embedding, shaped like vLLM's (`.outputs.embedding`, `.prompt_token_ids`, `.request_id`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    arrival_time: float | None = field(default=None, repr=False)
    finish_time: float | None = field(default=None, repr=False)
    error: str | None = None
