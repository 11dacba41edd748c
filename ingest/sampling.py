"""A job's sampling defaults merged with a row's overrides, as the engine's `SamplingParams` (the engine is
imported only when called, so the workers' job API loads without it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

INTEGER_PARAMS = ("max_tokens", "top_k", "seed", "n")


def sampling_params(defaults: dict[str, Any], overrides: dict[str, Any]) -> SamplingParams:
    """The job defaults with a row's overrides; ValueError/TypeError name the bad parameter."""
    from engine.sampling_params import SamplingParams

    merged = {**defaults, **{name: _integral(name, value) for name, value in overrides.items()}}
    if merged.get("n", 1) != 1:
        raise ValueError(f"n must be 1 in batch jobs (one completion per row), got {merged['n']!r}")
    return SamplingParams(**merged)


def _integral(name: str, value: Any) -> Any:
    """8.0 -> 8 for integer parameters: pandas turns integer columns with nulls into floats."""
    if name in INTEGER_PARAMS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value
