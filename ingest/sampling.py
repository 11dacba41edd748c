"""A job's sampling defaults merged with a row's overrides, as the engine's `SamplingParams` (the engine is
imported only when called, so the workers' job API loads without it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

INTEGER_PARAMS = ("max_tokens", "top_k", "seed", "n")
MAX_TOP_K = 1 << 20  # beyond any vocabulary; the row's check against the model's own is `check_for_model`
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TEMPERATURE = 1e4


def sampling_params(defaults: dict[str, Any], overrides: dict[str, Any]) -> SamplingParams:
    """The job defaults with a row's overrides; ValueError/TypeError name the bad parameter."""
    from engine.sampling_params import SamplingParams

    merged = {**defaults, **{name: _integral(name, value) for name, value in overrides.items()}}
    if merged.get("n", 1) != 1:
        raise ValueError(f"n must be 1 in batch jobs (one completion per row), got {merged['n']!r}")
    _check_bounds(merged)
    return SamplingParams(**merged)


def _check_bounds(params: dict[str, Any]) -> None:
    """Values the engine would accept but torch or the detokenizer could not take: ValueError names the field."""
    top_k, temperature = params.get("top_k"), params.get("temperature")
    if isinstance(top_k, int) and top_k > MAX_TOP_K:
        raise ValueError(f"top_k must be at most {MAX_TOP_K}, got {top_k}")
    if isinstance(temperature, float) and not temperature <= MAX_TEMPERATURE:
        raise ValueError(f"temperature must be a finite number <= {MAX_TEMPERATURE:g}, got {temperature!r}")
    stop = params.get("stop")
    if isinstance(stop, list | tuple) and (len(stop) > MAX_STOP or
                                          any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stop)):
        raise ValueError(f"stop: at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")
    stop_ids = params.get("stop_token_ids")
    if isinstance(stop_ids, list | tuple) and len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")


def check_for_model(params: SamplingParams, vocab_size: int) -> None:
    """ValueError for a value out of the loaded model's range: top_k above its vocabulary, a stop token id
    outside it."""
    if params.top_k > vocab_size:
        raise ValueError(f"top_k must be at most the vocabulary size ({vocab_size}), got {params.top_k}")
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")


def _integral(name: str, value: Any) -> Any:
    """8.0 -> 8 for integer parameters: pandas turns integer columns with nulls into floats."""
    if name in INTEGER_PARAMS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value
