"""`tokenmill run` on OpenAI JSONL: rows that all name one bundled model run on it without --model (here the
bundled embedding model, not the default generator); rows that all name a model the run does not serve are
refused before any model loads, with the models named; --model given on the command line stays the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from storage.formats.jsonl import models_named
from storage.objectstore import open_store
from tests.jobs.jobhelpers import assert_each_id_once
from tokenmill.cli import main

EMBEDDER = "all-minilm-l6-v2"


def embedding_line(custom_id: str, model: str | None, text: str) -> dict:
    body = {"input": text} if model is None else {"model": model, "input": text}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}


def write(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run(tmp_path: Path, source: Path, *options: str) -> int:
    return main(["run", str(source), "--output", str(tmp_path / "out"), "--database-url",
                 f"sqlite:///{tmp_path / 'db'}", "--openai-output", *options])


@pytest.mark.real_model  # runs a bundled model
def test_rows_naming_one_bundled_model_run_on_it_without_model(tmp_path: Path) -> None:
    lines = [embedding_line(f"e{i}", EMBEDDER, f"sentence number {i}") for i in range(3)]
    assert run(tmp_path, write(tmp_path / "rows.jsonl", lines)) == 0
    results, errors, manifest = assert_each_id_once(open_store(str(tmp_path / "out")), [f"e{i}" for i in range(3)])
    assert errors == [] and manifest["model"] == EMBEDDER and manifest["counts"]["completed"] == 3
    outputs = [json.loads(line) for line in (tmp_path / "out" / "batch_output.jsonl").read_text().splitlines()]
    assert {len(line["response"]["body"]["data"][0]["embedding"]) for line in outputs} == {384}


def test_rows_naming_only_models_not_served_are_refused_before_loading(tmp_path: Path, capsys) -> None:
    lines = [embedding_line("a", "text-embedding-3-small", "x"), embedding_line("b", "gpt-5", "y"),
             embedding_line("c", "gpt-5", "z")]
    assert run(tmp_path, write(tmp_path / "rows.jsonl", lines)) == 2
    message = capsys.readouterr().err
    assert "'gpt-5' (2 rows, first on line 2)" in message and "'text-embedding-3-small' (1 rows" in message
    assert "'smollm2-135m'" in message and "--model" in message
    assert not (tmp_path / "out").exists()


def test_an_explicit_model_is_kept(tmp_path: Path, capsys) -> None:
    source = write(tmp_path / "rows.jsonl", [embedding_line("a", EMBEDDER, "x"), embedding_line("b", EMBEDDER, "y")])
    assert run(tmp_path, source, "--model", "smollm2-135m") == 2  # not switched to the rows' model
    assert f"'{EMBEDDER}' (2 rows, first on line 1)" in capsys.readouterr().err
    mixed = write(tmp_path / "mixed.jsonl", [embedding_line("named", EMBEDDER, "x"), {"not": "a row"},
                                             embedding_line("bare", None, "y")])
    with mixed.open("rb") as file:
        assert models_named(file) == {EMBEDDER: (1, 1), None: (2, 2)}
