"""Failures inside a run are per request, as OpenAI's (issue #57): a request the engine cannot run fails alone and
the batch completes, and each failed request's line in the error file is OpenAI's, an HTTP error `response`
(500 `server_error` for the server's failure, 400 `invalid_request_error` for the request's) with `error` null.
Judged by the official `openai` SDK against an API whose batches run in process."""

from __future__ import annotations

import json

import jsonschema
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject

from tests.jobs.openai_shapes import BATCH_OUTPUT_LINE
from tests.jobs.test_engine_loop import PoisonedEngine
from tests.jobs.test_openai_api import TERMINAL, chat_line, client, running_api, submit, wait_for

POISON = "POISON-PILL"


def lines_of(sdk, file_id: str) -> list[dict]:
    return [json.loads(line) for line in sdk.files.content(file_id).text.splitlines()]


def test_a_request_the_engine_cannot_run_fails_alone_and_the_batch_completes(sessions, tmp_path,
                                                                             llm_engine) -> None:
    """A row whose every engine step raises (as a row that crashes the model would): the batch completes, the
    others' results in its output file, that row once in its error file as a 500."""
    poisoned = PoisonedEngine(llm_engine, lambda request_id, token_ids: POISON in llm_engine.tokenizer.decode(
        token_ids))
    lines = [chat_line(f"ok-{i}", max_tokens=3, temperature=0) for i in range(4)]
    lines.insert(1, chat_line("poison", content=f"Repeat {POISON}.", max_tokens=3, temperature=0))
    with running_api(sessions, str(tmp_path / "bucket"), poisoned) as (base_url, key, _, _):  # its runs close
        sdk = client(base_url, key)  # their engine service
        batch = wait_for(sdk, submit(sdk, lines).id, TERMINAL, timeout_s=120)
        assert batch.status == "completed", batch.errors
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (5, 4, 1)
        outputs, errors = lines_of(sdk, batch.output_file_id), lines_of(sdk, batch.error_file_id)
    assert sorted(line["custom_id"] for line in outputs) == [f"ok-{i}" for i in range(4)]
    for line in outputs:
        assert ChatCompletion.model_validate(line["response"]["body"]).usage.completion_tokens <= 3
    [failed] = errors
    jsonschema.validate(failed, BATCH_OUTPUT_LINE)
    assert failed["custom_id"] == "poison" and failed["error"] is None and failed["id"].startswith("batch_req_")
    response = failed["response"]
    assert response["status_code"] == 500 and response["request_id"] == failed["id"]
    error = ErrorObject.model_validate(response["body"]["error"])
    assert (error.type, error.code, error.param) == ("server_error", "engine_error", None)
    assert "POISON" not in error.message and "RuntimeError" in error.message
    assert not llm_engine.has_unfinished_requests()


def test_a_bad_request_is_a_400_line_in_the_error_file(sessions, tmp_path, llm_engine) -> None:
    with running_api(sessions, str(tmp_path / "bucket"), llm_engine) as (base_url, key, _, _):
        sdk = client(base_url, key)
        batch = wait_for(sdk, submit(sdk, [chat_line("bad", max_tokens=2, temperature=-1)]).id, TERMINAL)
        assert batch.status == "completed" and batch.output_file_id is None, batch.errors
        assert (batch.request_counts.completed, batch.request_counts.failed) == (0, 1)
        [line] = lines_of(sdk, batch.error_file_id)
    jsonschema.validate(line, BATCH_OUTPUT_LINE)
    assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
    assert set(line["response"]) == {"status_code", "request_id", "body"} and line["response"]["status_code"] == 400
    assert set(line["response"]["body"]["error"]) == {"message", "type", "param", "code"}
    error = ErrorObject.model_validate(line["response"]["body"]["error"])
    assert (error.type, error.code) == ("invalid_request_error", "invalid_parameter") and "temperature" in error.message
