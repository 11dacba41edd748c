"""OpenAI's request semantics for OpenAI-format rows: a `model` the job does not serve fails the row with
`model_not_found`; omitted sampling fields take OpenAI's defaults (temperature 1, top_p 1) unless the job set
its own."""

from __future__ import annotations

import json

from ingest.row_checks import RowChecks
from storage.formats import RowError
from storage.formats.jsonl import parse_line
from tokenmill.cli import build_parser
from tokenmill.options import sampling_kwargs

SERVED = {"smollm2-135m", "gpt-4o-mini"}


def row(model: str | None, **body):
    line = {"custom_id": "r", "method": "POST", "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **body}}
    if model is not None:
        line["body"]["model"] = model
    return parse_line(0, json.dumps(line).encode())


def prepared(engine, request, defaults=None):
    checked = RowChecks(defaults or {}, frozenset(SERVED)).check(engine, request)
    return checked if isinstance(checked, RowError) else (checked.request, checked.params)


def test_a_row_naming_a_model_the_job_does_not_serve_fails_with_model_not_found(llm_engine) -> None:
    error = prepared(llm_engine, row("gpt-5"))
    assert isinstance(error, RowError) and error.code == "model_not_found"
    assert "'gpt-5'" in error.message and "'gpt-4o-mini', 'smollm2-135m'" in error.message
    for served in ("smollm2-135m", "gpt-4o-mini", None):  # the model, an alias, or no model at all
        assert not isinstance(prepared(llm_engine, row(served)), RowError), served


def test_omitted_sampling_fields_take_openai_defaults_unless_the_job_gives_its_own(llm_engine) -> None:
    _, params = prepared(llm_engine, row("smollm2-135m"))
    assert (params.temperature, params.top_p) == (1.0, 1.0)
    _, params = prepared(llm_engine, row("smollm2-135m"), {"temperature": 0.0, "top_p": 0.5})
    assert (params.temperature, params.top_p) == (0.0, 0.5)
    _, params = prepared(llm_engine, row("smollm2-135m", temperature=0.7), {"temperature": 0.0})
    assert params.temperature == 0.7


def test_tokenmill_run_sets_a_job_temperature_only_when_given() -> None:
    parser = build_parser()
    assert "temperature" not in sampling_kwargs(parser.parse_args(["run"]))
    assert sampling_kwargs(parser.parse_args(["run", "--temperature", "0"]))["temperature"] == 0
    assert parser.parse_args(["run", "--served-model-name", "gpt-4o-mini"]).served_model_name == ["gpt-4o-mini"]
    assert sampling_kwargs(parser.parse_args(["generate", "hi"]))["temperature"] == 0  # a quick look stays greedy
