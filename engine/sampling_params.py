"""Per-request generation settings, named as in vLLM's `SamplingParams`."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.structured_outputs import StructuredOutputsParams

SEED_LIMIT = 1 << 63  # seeds are signed 64-bit in torch
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


@dataclass
class SamplingParams:
    """How to generate the completion of one prompt.

    temperature 0 means greedy; `seed` makes a sampled request reproducible on its own,
    whatever else runs in the same batch.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (JSON schema, regex, ...)
    logprobs: int | None = None  # the sampled token's log probability and the k most likely (0: none of those)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        checks = [
            (isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (_is_number(self.temperature) and self.temperature >= 0,
             f"temperature must be a number >= 0, got {self.temperature!r}"),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and self.top_k >= 0 or self.top_k == -1,
             f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}"),
            (self.seed is None or isinstance(self.seed, int) and not isinstance(self.seed, bool)
             and 0 <= self.seed < SEED_LIMIT, f"seed must be an integer in [0, 2^63), got {self.seed!r}"),
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings"),
            (all(isinstance(t, int) for t in self.stop_token_ids), "stop_token_ids must be integers"),
            (self.logprobs is None or isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
             and 0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got "
                                                     f"{self.logprobs!r}"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def has_extras(self) -> bool:
        """Asks for work beyond plain sampling (masks, logprobs): unset, the sampler's fast path runs."""
        return self.structured_outputs is not None or self.logprobs is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def context_length_error(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> str | None:
    """Why a prompt and its max_tokens do not fit the model's context, or None when they do."""
    if num_prompt_tokens + max_tokens <= max_model_len:
        return None
    return (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
            f"({max_model_len}), the model's context")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
