"""A job's sampling defaults merged with a row's overrides, as the engine's `SamplingParams` (the engine is
imported only when called, so the workers' job API loads without it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.beam_search import BeamSearchParams
    from engine.sampling_params import SamplingParams

INTEGER_PARAMS = ("max_tokens", "top_k", "seed", "n", "logprobs", "top_logprobs", "min_tokens", "beam_width")
ALLOW_BEAM_SEARCH = "allow_beam_search"  # a job default: OpenAI rows may set beam_width (not an OpenAI field)
# what a beam row may set besides beam_width, n and max_tokens: sampling knobs a deterministic search ignores
BEAM_IGNORED = {"temperature": 0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": []}
MAX_TOP_K = 1 << 20  # beyond any vocabulary; the row's check against the model's own is `check_for_model`
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TEMPERATURE = 1e4
MAX_N = 16  # completions per row


class ResponseFormatError(ValueError):
    """A row's `response_format` is malformed, or its schema invalid (the row fails, not the job)."""


def sampling_params(defaults: dict[str, Any], overrides: dict[str, Any]) -> SamplingParams | BeamSearchParams:
    """The job defaults with a row's overrides; ValueError/TypeError name the bad parameter. With a `beam_width`
    (the row's or the job's), the row is a beam search: `beam_search_params`."""
    from engine.sampling_params import SamplingParams

    merged = {**defaults, **{name: _integral(name, value) for name, value in overrides.items()}}
    merged.pop(ALLOW_BEAM_SEARCH, None)
    if merged.get("beam_width") is not None:
        return beam_search_params(merged, overrides)
    merged.pop("beam_width", None)
    if (bias := merged.get("logit_bias")) is not None:
        merged["logit_bias"] = logit_bias_of(bias)
    merged["logprobs"] = logprobs_of(merged.pop("logprobs", None), merged.pop("top_logprobs", None))
    if (response_format := merged.pop("response_format", None)) is not None:
        merged["structured_outputs"] = structured_outputs(response_format)
    _check_bounds(merged)
    return SamplingParams(**merged)


def beam_search_params(merged: dict[str, Any], overrides: dict[str, Any]) -> BeamSearchParams:
    """A beam row's search: `beam_width` beams for `max_tokens`, its best `n` (default 1) kept. The job's sampling
    defaults (temperature, top_p, top_k, seed) do not apply to a deterministic search; a row that sets one, or any
    other field (stop, logprobs, penalties, response_format...), is refused."""
    from engine.beam_search import BeamSearchParams

    merged = dict(merged)
    width, n = merged.pop("beam_width"), merged.pop("n", None) or 1
    max_tokens, ignore_eos = merged.pop("max_tokens", 16), bool(merged.pop("ignore_eos", False))
    clashing = sorted(name for name, value in merged.items()
                      if value not in (None, [], {}, BEAM_IGNORED.get(name, ...))
                      and (name in overrides or name not in BEAM_IGNORED))
    if clashing:
        raise ValueError(f"beam_width does not combine with {', '.join(clashing)}: a beam search is deterministic")
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos)
    if not isinstance(n, int) or not 1 <= n <= width:
        raise ValueError(f"n must be an integer in [1, beam_width={width}] with beam search, got {n!r}")
    return params


def kept_beams(params: Any, request_params: dict[str, Any], defaults: dict[str, Any]) -> int | None:
    """How many of a beam row's beams its output keeps (its `n`, else the job's, else 1); None for a sampled row."""
    if getattr(params, "beam_width", None) is None:
        return None
    return request_params.get("n") or defaults.get("n") or 1


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


def _check_bounds(params: dict[str, Any]) -> None:
    """Values the engine would accept but torch or the detokenizer could not take: ValueError names the field."""
    top_k, temperature, n = params.get("top_k"), params.get("temperature"), params.get("n")
    if isinstance(n, int) and n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N}, got {n}")
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
