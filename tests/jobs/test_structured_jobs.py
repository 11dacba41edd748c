"""A job with response_format rows on the real model: every json_schema row parses and validates, json_object
rows parse, bad schemas and unsupported fields fail their row only, and every batch_output.jsonl line has the
documented OpenAI Batch shape."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from ingest.intake import submit
from storage.formats import BATCH_OUTPUT_KEY
from storage.objectstore import open_store
from tests.jobs.jobhelpers import assert_each_id_once, new_job
from tests.jobs.openai_shapes import BATCH_OUTPUT_LINE
from workers.inprocess import run_job

pytestmark = pytest.mark.real_model
SCHEMAS = [
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]}},
     "required": ["sentiment"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
]
QUESTIONS = ["Classify: 'I loved this film.'", "Give a large city and its population.", "Tag: 'a cat on a mat'"]


def chat_line(custom_id: str, content: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2-135m", "messages": [{"role": "user", "content": content}], **body}}


def run_jsonl_job(sessions, engine_provider, tmp_path: Path, lines: list[dict]):
    """Run the lines as a batch.jsonl job (greedy, 8 tokens, OpenAI output); its output store once completed."""
    path = tmp_path / "batch.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    job = run_job(sessions, submit(sessions, new_job(str(path), str(tmp_path / "out"), "smollm2-135m",
                                                     sampling={"max_tokens": 8, "temperature": 0.0},
                                                     openai_output=True)).job.id, engine_provider)
    assert job.status == "completed", job.error
    return open_store(str(tmp_path / "out"))


def test_json_rows_validate_and_bad_rows_fail_alone(sessions, engine_provider, tmp_path: Path) -> None:
    lines = [chat_line(f"schema-{i}", QUESTIONS[i % 3], max_tokens=48, temperature=0.7 * (i % 2), seed=i,
                       response_format={"type": "json_schema",
                                        "json_schema": {"name": "answer", "schema": SCHEMAS[i % 3], "strict": True}})
             for i in range(6)]
    lines += [chat_line("object", "Give the name and the color of an apple as a JSON object.", max_tokens=48,
                        response_format={"type": "json_object"}),
              chat_line("bad-schema", "x", response_format={"type": "json_schema",
                                                            "json_schema": {"schema": {"type": "nonsense"}}}),
              chat_line("tools", "x", tools=[{"type": "function", "function": {"name": "f"}}]),
              chat_line("chat-logprobs", "Name a color.", max_tokens=4, logprobs=True, top_logprobs=2),
              {"custom_id": "free", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "The sky is", "max_tokens": 4, "logprobs": 3}}]
    store = run_jsonl_job(sessions, engine_provider, tmp_path, lines)
    results, errors, _ = assert_each_id_once(store, [line["custom_id"] for line in lines])
    assert {e["custom_id"]: e["code"] for e in errors} == {"bad-schema": "invalid_response_format",
                                                           "tools": "unsupported_parameter"}
    texts = {r["custom_id"]: r for r in results}
    for i in range(6):
        jsonschema.validate(json.loads(texts[f"schema-{i}"]["text"]), SCHEMAS[i % 3])
    assert isinstance(json.loads(texts["object"]["text"]), dict)
    batch = [json.loads(line) for line in store.get_bytes(BATCH_OUTPUT_KEY).decode().splitlines()]
    assert len(batch) == len(lines)
    for line in batch:
        jsonschema.validate(line, BATCH_OUTPUT_LINE)
    by_id = {line["custom_id"]: line for line in batch}
    chat = by_id["chat-logprobs"]["response"]["body"]["choices"][0]
    assert "".join(t["token"] for t in chat["logprobs"]["content"]).startswith(chat["message"]["content"])
    assert all(len(t["top_logprobs"]) == 2 for t in chat["logprobs"]["content"])
    text = by_id["free"]["response"]["body"]["choices"][0]
    assert len(text["logprobs"]["tokens"]) == texts["free"]["completion_tokens"] == 4
    assert all(len(top) == 3 for top in text["logprobs"]["top_logprobs"])
    assert by_id["object"]["response"]["body"]["choices"][0]["logprobs"] is None
    assert texts["free"]["logprobs"] is not None and texts["object"]["logprobs"] is None  # the Parquet column


def test_n_choices_become_one_line_and_one_part_row_each(sessions, engine_provider, tmp_path: Path) -> None:
    from storage.formats import read_part

    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0], "strict": True}}
    lines = [chat_line("three", QUESTIONS[0], n=3, temperature=1.0, seed=4, max_tokens=16, response_format=schema),
             {"custom_id": "one", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": "Hi", "max_tokens": 3}}]
    store = run_jsonl_job(sessions, engine_provider, tmp_path, lines)
    part = read_part(store, next(k for k in store.list() if k.startswith("part-00000-"))).to_pylist()
    assert [(r["custom_id"], r["choice_index"]) for r in part] == [("three", 0), ("three", 1), ("three", 2),
                                                                   ("one", 0)]
    batch = [json.loads(line) for line in store.get_bytes(BATCH_OUTPUT_KEY).decode().splitlines()]
    assert [line["custom_id"] for line in batch] == ["three", "one"]
    for line in batch:
        jsonschema.validate(line, BATCH_OUTPUT_LINE)
    body = batch[0]["response"]["body"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice in body["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMAS[0])
    assert body["usage"]["completion_tokens"] == sum(r["completion_tokens"] for r in part[:3])
    assert body["usage"]["prompt_tokens"] == part[0]["prompt_tokens"]
    manifest = json.loads(store.get_bytes("manifest.json"))
    assert manifest["counts"] == {"total": 2, "completed": 2, "failed": 0}
