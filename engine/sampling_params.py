"""Per-request generation settings, named as in vLLM's `SamplingParams`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

SEED_LIMIT = 1 << 63  # seeds are signed 64-bit in torch
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint, named as in vLLM: `json` (a JSON schema, dict or text), `regex`, `choice` (the
    output is one of these strings), `grammar` (EBNF, GBNF-style) or `json_object=True` (any JSON object)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens

    def __post_init__(self) -> None:
        set_kinds = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KINDS)}, "
                             f"got {set_kinds or 'none'}")
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its text)")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on (the cache key)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict | list):
            value = json.dumps(value, sort_keys=True)
        return self.kind, str(value), self.disable_any_whitespace


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
    presence_penalty: float = 0.0  # subtracted from tokens already generated (OpenAI's, in [-2, 2])
    frequency_penalty: float = 0.0  # times each generated token's count
    repetition_penalty: float = 1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    min_tokens: int = 0  # EOS and stop tokens are masked until this many tokens are generated

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
            (all(_is_number(v) and -2 <= v <= 2 for v in (self.presence_penalty, self.frequency_penalty)),
             "presence_penalty and frequency_penalty must be numbers in [-2, 2]"),
            (_is_number(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}"),
            (self.logit_bias is None or isinstance(self.logit_bias, dict) and all(
                isinstance(t, int) and t >= 0 and _is_number(b) and -100 <= b <= 100
                for t, b in self.logit_bias.items()), "logit_bias must map token ids to numbers in [-100, 100]"),
            (isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool) and self.min_tokens >= 0,
             f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs must be a StructuredOutputsParams"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def has_extras(self) -> bool:
        """Asks for work beyond plain sampling (masks, logprobs): unset, the sampler's fast path runs."""
        return (self.structured_outputs is not None or self.logprobs is not None or self.has_penalties
                or bool(self.logit_bias) or self.min_tokens > 0)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

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
