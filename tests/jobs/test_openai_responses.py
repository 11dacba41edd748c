"""`/v1/responses` batch lines, judged by the official `openai` SDK: Responses bodies (string or message-item
input, instructions, max_output_tokens, text.format) run as chat rows on the real model, and their output lines
are `openai.types.responses.Response` objects whose greedy text is the chat path's; unsupported fields fail
their line."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response

from storage.formats import BATCH_OUTPUT_KEY, Request, RowError, line_error
from storage.formats.jsonl import parse_value
from tests.jobs.test_openai_api import ALIAS, MODEL, TERMINAL, client, jsonl, running_api, wait_for
from tests.jobs.test_structured_jobs import run_jsonl_job

RESPONSES = "/v1/responses"
SENTIMENT = {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
             "required": ["sentiment"], "additionalProperties": False}
INSTRUCTIONS = "Answer with one word."
ARITHMETIC = "What is 2+2? Reply with the number only."  # stops well before 16 tokens


def responses_line(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": RESPONSES, "body": {"model": MODEL, **body}}


def chat_line(custom_id: str, messages: list[dict], max_tokens: int) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}}


def run_batch(sdk, endpoint: str, lines: list[dict]):
    upload = sdk.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")
    return wait_for(sdk, batch.id, TERMINAL, timeout_s=120)


def output_bodies(sdk, batch) -> dict[str, dict]:
    lines = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    return {line["custom_id"]: line["response"]["body"] for line in lines}


@pytest.fixture
def api(sessions, tmp_path, llm_engine):
    with running_api(sessions, str(tmp_path / "bucket"), llm_engine) as (base_url, key, _, _service):
        yield client(base_url, key)


@pytest.fixture
def parked(sessions, tmp_path):
    """An API whose batches are checked and made but never run: no model loads."""
    with running_api(sessions, str(tmp_path / "bucket"), None, dispatch=lambda job_id: None) as running:
        yield client(running[0], running[1])


def test_responses_lines_give_response_objects_with_the_chat_paths_greedy_text(api) -> None:
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}]
    schema_format = {"type": "json_schema", "name": "sentiment", "schema": SENTIMENT, "strict": True}
    lines = [responses_line("plain", input=ARITHMETIC, temperature=0, max_output_tokens=16),
             responses_line("items", input=items, instructions=INSTRUCTIONS, temperature=0, max_output_tokens=16,
                            model=ALIAS),
             responses_line("cut", input=[{"role": "user", "content": "Count from 1 to 20, separated by commas."}],
                            temperature=0, max_output_tokens=3),
             responses_line("schema", input="Classify: 'I loved this film.'", temperature=0, max_output_tokens=16,
                            text={"format": schema_format})]
    batch = run_batch(api, RESPONSES, lines)
    assert batch.status == "completed" and batch.endpoint == RESPONSES, batch.errors
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 0)
    bodies = output_bodies(api, batch)
    responses = {custom_id: Response.model_validate(body) for custom_id, body in bodies.items()}
    assert set(responses) == {"plain", "items", "cut", "schema"}
    for custom_id, response in responses.items():
        assert response.object == "response" and response.id.startswith("resp_")
        [message] = response.output
        assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
        assert message.content[0].type == "output_text" and message.content[0].annotations == []
        usage = response.usage
        assert usage.input_tokens > 0 and usage.output_tokens > 0, custom_id
        assert usage.total_tokens == usage.input_tokens + usage.output_tokens
        assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
        assert response.temperature == 0 and response.top_p == 1.0
    assert responses["items"].model == ALIAS and responses["plain"].model == MODEL  # the name each line asked for
    assert responses["items"].instructions == INSTRUCTIONS and responses["plain"].instructions is None
    assert responses["plain"].max_output_tokens == 16 and responses["plain"].text.format.type == "text"

    cut = responses["cut"]
    assert (cut.status, cut.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert cut.usage.output_tokens == 3
    assert cut.output[0].status == "incomplete" and cut.completed_at is None
    assert responses["plain"].status == "completed" and responses["plain"].incomplete_details is None

    schema = responses["schema"]
    jsonschema.validate(json.loads(schema.output_text), SENTIMENT)
    assert schema.text.format.type == "json_schema" and schema.text.format.schema_ == SENTIMENT
    assert schema.text.format.strict is True and schema.text.format.name == "sentiment"

    chats = run_batch(api, "/v1/chat/completions", [
        chat_line("plain", [{"role": "user", "content": ARITHMETIC}], 16),
        chat_line("items", [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "Name a fruit."}],
                  16)])
    assert chats.status == "completed", chats.errors
    for custom_id, body in output_bodies(api, chats).items():
        completion = ChatCompletion.model_validate(body)
        assert responses[custom_id].output_text == completion.choices[0].message.content, custom_id
        assert responses[custom_id].usage.input_tokens == completion.usage.prompt_tokens


def test_unsupported_fields_and_other_urls_refuse_their_lines_at_creation(parked) -> None:
    lines = [responses_line("ok", input="Hi"),
             responses_line("tools", input="Hi", tools=[{"type": "function", "name": "f", "parameters": {}}]),
             responses_line("chained", input="Hi", previous_response_id="resp_1", stream=True),
             responses_line("image", input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
             {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}]}}]
    batch = run_batch(parked, RESPONSES, lines)
    assert batch.status == "failed"
    assert [(e.line, e.code) for e in batch.errors.data] == [
        (2, "unsupported_parameter"), (3, "unsupported_parameter"), (4, "unsupported_content"), (5, "invalid_url")]
    assert batch.errors.data[0].message == "tools is not supported by tokenmill"
    assert batch.errors.data[1].message == "previous_response_id, stream are not supported by tokenmill"


def test_unsupported_and_bad_lines_land_in_the_error_file(sessions, engine_provider, tmp_path: Path) -> None:
    lines = [responses_line("ok", input="Hi", max_output_tokens=2, instructions=INSTRUCTIONS),
             responses_line("reasoning", input="Hi", reasoning={"effort": "high"}),
             responses_line("bad-schema", input="Hi", text={"format": {"type": "json_schema", "name": "x",
                                                                       "schema": {"type": "nonsense"}}})]
    store = run_jsonl_job(sessions, engine_provider, tmp_path, lines)
    batch = {line["custom_id"]: line for line in map(json.loads, store.get_bytes(BATCH_OUTPUT_KEY).splitlines())}
    assert {custom_id: line_error(line) and line_error(line)["code"] for custom_id, line in batch.items()} == {
        "ok": None, "reasoning": "unsupported_parameter", "bad-schema": "invalid_response_format"}
    assert line_error(batch["reasoning"])["message"] == "reasoning is not supported by tokenmill"
    assert Response.model_validate(batch["ok"]["response"]["body"]).usage.output_tokens <= 2
    errors = [json.loads(line) for line in store.get_bytes("errors.jsonl").splitlines()]
    assert sorted(e["custom_id"] for e in errors) == ["bad-schema", "reasoning"]


@pytest.mark.parametrize("body, expected", [
    ({"input": "Hi"}, [{"role": "user", "content": "Hi"}]),
    ({"input": [{"role": "developer", "content": "Be terse."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                                {"type": "input_text", "text": "b"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "ab"}]}],
      "instructions": "Rules."},
     [{"role": "system", "content": "Rules."}, {"role": "system", "content": "Be terse."},
      {"role": "user", "content": "ab"}, {"role": "assistant", "content": "ab"}]),
])
def test_input_becomes_chat_messages(body, expected) -> None:
    request = parse_value(0, responses_line("r", **body))
    assert isinstance(request, Request) and request.endpoint == RESPONSES and request.messages == expected


def test_sampling_fields_and_text_format_become_the_chat_rows_params() -> None:
    request = parse_value(0, responses_line("r", input="Hi", max_output_tokens=5, temperature=0.5, top_p=0.9,
                                            text={"format": {"type": "json_object"}}, tool_choice="auto",
                                            tools=[], stream=False, background=False, store=True, metadata={"a": "b"}))
    assert request.params == {"max_tokens": 5, "temperature": 0.5, "top_p": 0.9,
                              "response_format": {"type": "json_object"}}
    schema = parse_value(0, responses_line("r", input="Hi", text={"format": {"type": "json_schema", "name": "s",
                                                                             "schema": SENTIMENT}}))
    assert schema.params["response_format"] == {"type": "json_schema",
                                                "json_schema": {"name": "s", "schema": SENTIMENT, "strict": None}}


@pytest.mark.parametrize("body, code, message", [
    ({"input": ""}, "missing_input", "input is null or empty"),
    ({"input": 3}, "invalid_input", "input must be a string or a list of message items"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "unsupported_content", "only message items"),
    ({"input": [{"role": "tool", "content": "x"}]}, "invalid_input", "input[0].role must be one of"),
    ({"input": "Hi", "max_output_tokens": 0}, "invalid_parameter", "max_output_tokens must be a positive integer"),
    ({"input": "Hi", "instructions": ["x"]}, "invalid_parameter", "instructions must be a string"),
    ({"input": "Hi", "text": {"format": {"type": "grammar"}}}, "invalid_response_format", "text.format.type must be"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": SENTIMENT}}}, "invalid_response_format",
     "text.format.name must be"),
    ({"input": "Hi", "text": {"verbosity": "low"}}, "unsupported_parameter", "text.verbosity is not supported"),
    ({"input": "Hi", "include": ["reasoning.encrypted_content"], "background": True}, "unsupported_parameter",
     "background, include are not supported by tokenmill"),
])
def test_bad_bodies_fail_the_row(body, code, message) -> None:
    error = parse_value(0, responses_line("r", **body))
    assert isinstance(error, RowError) and error.code == code and message in error.message, error
