"""The OpenAI request body beyond the prompt: response_format (JSONL object or Parquet JSON text) becomes the
engine's structured_outputs; fields tokenmill does not honour, and non-text content, are row errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.structured_outputs import StructuredOutputsParams
from ingest.sampling import ResponseFormatError, sampling_params
from storage.formats import Request, RowError
from tests.jobs.jobhelpers import write_parquet
from tests.jobs.test_formats import batch_line, open_local, rows_of

SCHEMA = {"type": "object", "properties": {"label": {"enum": ["a", "b"]}}, "required": ["label"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "label", "schema": SCHEMA, "strict": True}}


def test_jsonl_response_format_unsupported_fields_and_content(tmp_path: Path) -> None:
    lines = [batch_line("schema", response_format=JSON_SCHEMA),
             batch_line("object", response_format={"type": "json_object"}, presence_penalty=0, tools=[], stream=False,
                        logprobs=False, n=1),
             batch_line("tools", tools=[{"type": "function", "function": {"name": "f"}}]),
             batch_line("many", audio={"voice": "alloy"}, prediction={"type": "content", "content": "x"},
                        presence_penalty=0.5, logit_bias={"1": 5}),
             batch_line("image", messages=[{"role": "user", "content": [
                 {"type": "text", "text": "what is this?"},
                 {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}])]
    (tmp_path / "b.jsonl").write_text("\n".join(lines))
    schema, obj, tools, many, image = rows_of(open_local(tmp_path / "b.jsonl"))
    assert isinstance(schema, Request) and schema.params == {"response_format": JSON_SCHEMA}
    assert isinstance(obj, Request) and obj.params == {"response_format": {"type": "json_object"}, "n": 1,
                                                       "logprobs": False, "presence_penalty": 0}
    assert isinstance(tools, RowError) and (tools.code, tools.message) == (
        "unsupported_parameter", "tools is not supported by tokenmill")
    assert isinstance(many, RowError) and many.message == "audio, prediction are not supported " \
                                                          "by tokenmill"
    assert isinstance(image, RowError) and image.code == "unsupported_content" and "image_url" in image.message


def test_parquet_response_format_column_is_json_text(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "in.parquet", {
        "custom_id": ["a", "b"], "prompt": ["x", "y"],
        "response_format": [json.dumps(JSON_SCHEMA), None]})
    a, b = rows_of(open_local(path))
    assert a.params == {"response_format": json.dumps(JSON_SCHEMA)} and b.params == {}
    params = sampling_params({"max_tokens": 8}, a.params)
    assert params.structured_outputs == StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


def test_response_format_mapping() -> None:
    assert sampling_params({}, {"response_format": {"type": "text"}}).structured_outputs is None
    assert sampling_params({}, {"response_format": {"type": "json_object"}}).structured_outputs.json_object
    job_default = sampling_params({"response_format": JSON_SCHEMA}, {})  # `tokenmill run --json-schema`
    assert job_default.structured_outputs.json == SCHEMA


@pytest.mark.parametrize("response_format, message", [
    ({"type": "xml"}, "type must be text, json_object or json_schema, got 'xml'"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema must be a JSON schema object"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}}, "invalid JSON schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"minLength": "two"}}}, "invalid JSON schema"),
    ("{not json", "response_format is not valid JSON"),
])
def test_bad_response_formats_fail_the_row(response_format, message) -> None:
    with pytest.raises(ResponseFormatError, match=message):
        sampling_params({}, {"response_format": response_format})


def test_logprobs_fields() -> None:
    assert sampling_params({}, {"logprobs": True, "top_logprobs": 3}).logprobs == 3  # chat
    assert sampling_params({}, {"logprobs": True}).logprobs == 0
    assert sampling_params({}, {"logprobs": False}).logprobs is None
    assert sampling_params({}, {"logprobs": 2.0}).logprobs == 2  # completions (a Parquet float column)
    with pytest.raises(ValueError, match="top_logprobs needs logprobs: true"):
        sampling_params({}, {"top_logprobs": 2})
    with pytest.raises(ValueError, match="logprobs must be an integer in"):
        sampling_params({}, {"logprobs": 50})


def test_run_json_schema_option_sets_every_rows_response_format(tmp_path: Path) -> None:
    import argparse

    from tokenmill.options import add_sampling_options, sampling_kwargs

    parser = argparse.ArgumentParser()
    add_sampling_options(parser)
    (tmp_path / "label.json").write_text(json.dumps(SCHEMA))
    kwargs = sampling_kwargs(parser.parse_args(["--json-schema", str(tmp_path / "label.json")]))
    assert kwargs["response_format"] == {"type": "json_schema", "json_schema": {"name": "label", "schema": SCHEMA,
                                                                               "strict": True}}
    assert "response_format" not in sampling_kwargs(parser.parse_args([]))
    assert sampling_params(kwargs, {}).structured_outputs.json == SCHEMA


def test_penalties_bias_and_min_tokens_fields() -> None:
    params = sampling_params({}, {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
                                  "logit_bias": {"42": -100, "7": 3}, "min_tokens": 4.0})
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -1, 1.2)
    assert params.logit_bias == {42: -100, 7: 3} and params.min_tokens == 4
    assert sampling_params({}, {"logit_bias": '{"5": 1}'}).logit_bias == {5: 1}  # a Parquet JSON-text column
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        sampling_params({}, {"logit_bias": {"a": 1}})
