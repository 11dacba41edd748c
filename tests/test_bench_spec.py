"""`tokenmill bench spec`: a short run prints both rows of a scenario and checks the tokens agree."""

from __future__ import annotations

import json

import pytest

from tokenmill.cli import main

pytestmark = pytest.mark.real_model


def test_bench_spec_prints_plain_and_speculative_rows_in_the_chosen_dtype(tmp_path, capsys):
    out = tmp_path / "spec.json"
    code = main(["bench", "spec", "--method", "ngram", "--scenarios", "a", "--copy-prompts", "2", "--copy-tokens",
                 "24", "--no-hf", "--dtype", "float32", "--batch-invariant", "--json", str(out)])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0
    assert "scenario a: 2/2 outputs identical with and without speculation" in printed, printed
    rows = json.loads(out.read_text())
    assert [r["system"] for r in rows] == ["tokenmill, no speculation", "tokenmill, ngram"]
    assert rows[0]["tokens"] == rows[1]["tokens"] > 0 and rows[1]["acceptance"] is not None
