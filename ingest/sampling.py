"""A job's sampling defaults merged with a row's overrides, as the engine's `SamplingParams` (the engine is
imported only when called, so the workers' job API loads without it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

INTEGER_PARAMS = ("max_tokens", "top_k", "seed", "n", "logprobs", "top_logprobs", "min_tokens")


class ResponseFormatError(ValueError):
    """A row's `response_format` is malformed, or its schema invalid (the row fails, not the job)."""


def sampling_params(defaults: dict[str, Any], overrides: dict[str, Any]) -> SamplingParams:
    """The job defaults with a row's overrides; ValueError/TypeError name the bad parameter."""
    from engine.sampling_params import SamplingParams

    merged = {**defaults, **{name: _integral(name, value) for name, value in overrides.items()}}
    if (bias := merged.get("logit_bias")) is not None:
        merged["logit_bias"] = logit_bias_of(bias)
    merged["logprobs"] = logprobs_of(merged.pop("logprobs", None), merged.pop("top_logprobs", None))
    if (response_format := merged.pop("response_format", None)) is not None:
        merged["structured_outputs"] = structured_outputs(response_format)
    return SamplingParams(**merged)


def logit_bias_of(bias: Any) -> dict[int, float]:
    """OpenAI's {"token id": bias} (JSON keys are strings; a Parquet column holds the JSON text)."""
    import json

    if isinstance(bias, str):
        try:
            bias = json.loads(bias)
        except ValueError:
            raise ValueError("logit_bias must be a JSON object of token id -> bias") from None
    if not isinstance(bias, dict):
        raise ValueError("logit_bias must be an object of token id -> bias")
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise ValueError("logit_bias keys must be token ids") from None


def logprobs_of(logprobs: Any, top_logprobs: Any) -> int | None:
    """The engine's `logprobs` (top-k count) from chat's `logprobs: true` + `top_logprobs: k` or completions'
    `logprobs: k`; None when not asked."""
    if isinstance(logprobs, bool) or logprobs is None:
        if top_logprobs not in (None, 0) and not logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return _integral("top_logprobs", top_logprobs or 0) if logprobs else None
    return _integral("logprobs", logprobs)


def structured_outputs(response_format: Any):
    """OpenAI's `response_format` (an object, or its JSON text from a Parquet column) as the engine's
    StructuredOutputsParams: `json_schema` (its `schema`, enforced whether `strict` or not) or `json_object`;
    `text` is None. JSON is generated without free whitespace, so a small model cannot pad it to max_tokens."""
    import json

    from engine.structured_outputs import StructuredOutputsParams, check_json_schema

    if isinstance(response_format, str):
        try:
            response_format = json.loads(response_format)
        except ValueError as problem:
            raise ResponseFormatError(f"response_format is not valid JSON: {problem}") from None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    if kind != "json_schema":
        raise ResponseFormatError(f"response_format.type must be text, json_object or json_schema, got {kind!r}")
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ResponseFormatError("response_format.json_schema.schema must be a JSON schema object")
    try:
        check_json_schema(schema)
    except ValueError as problem:
        raise ResponseFormatError(f"response_format: {problem}") from None
    return StructuredOutputsParams(json=schema, disable_any_whitespace=True)


def _integral(name: str, value: Any) -> Any:
    """8.0 -> 8 for integer parameters: pandas turns integer columns with nulls into floats."""
    if name in INTEGER_PARAMS and isinstance(value, float) and value.is_integer():
        return int(value)
    return value
