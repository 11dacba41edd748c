"""`speculative_config`, as in vLLM: {"method": "ngram" | "draft" | "self" | "medusa", "num_speculative_tokens": k,
...}."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft", "self", "medusa")


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # n-gram: longest suffix matched
    prompt_lookup_min: int = 2  # n-gram: shortest suffix matched
    model: str | None = None  # draft: a causal LM with the target's tokenizer (name or directory); medusa: a head dir
    draft_layers: int | None = None  # self: leading target layers used as the draft (default: a quarter)
    max_verify_tokens: int = 32  # adaptive: never verify more than this many tokens in one step
    min_acceptance: float = 0.0  # adaptive: never draft k tokens whose mean estimated acceptance is lower
    probe_every: int = 32  # adaptive: while no k pays, try a speculative step this often

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft" and not self.model:
            raise ValueError('speculative_config method "draft" needs "model" (a model name or directory)')
        if self.method == "medusa" and not self.model:
            raise ValueError('speculative_config method "medusa" needs "model" (a Medusa head directory, from '
                             '`tokenmill spec train-head`)')
        if not 0 <= self.min_acceptance <= 1:
            raise ValueError(f"min_acceptance must be in [0, 1], got {self.min_acceptance}")

    def self_draft_layers(self, total: int) -> int:
        """Leading target layers the self-speculative draft runs (of the target's `total`)."""
        layers = self.draft_layers or max(1, total // 4)
        if not 1 <= layers < total:
            raise ValueError(f"draft_layers must be in [1, {total - 1}], got {layers}")
        return layers

    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> SpeculativeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        if "method" not in settings:
            raise ValueError('speculative_config needs "method" ("ngram", "draft", "self" or "medusa")')
        return cls(**settings)
