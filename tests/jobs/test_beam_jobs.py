"""Beam search in jobs (docs/beam-search.md): a `beam_width` row (Parquet column, or an OpenAI body when the job
allows it) or the job's `--beam-width` runs the row as a beam search, its text the best beam's, equal to
`LLM.beam_search` (which tests/engine/test_beam_search.py holds to Hugging Face); sampled rows beside it are
untouched; OpenAI rows setting beam_width without the job's consent fail with unsupported_parameter, and beam rows
that also sample fail with invalid_parameter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ingest.sampling import sampling_params
from storage.objectstore import open_store
from tests.jobs.jobhelpers import assert_each_id_once, write_parquet
from tokenmill.cli import main

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
MAX_TOKENS = 8
FAST = ["--dtype", "float32", "--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--threads", "2",
        "--kv-cache-memory", "0.25", "--max-num-seqs", "32"]


@pytest.fixture(scope="module")
def reference(model_dir):
    from engine import LLM

    return LLM(dtype="float32", num_threads=2, kv_cache_memory=256 << 20, max_num_seqs=32, batch_invariant="auto")


def best_beam(llm, prompt: str, width: int) -> str:
    from engine import BeamSearchParams

    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS))
    return out.sequences[0].text


def greedy(llm, prompt: str) -> str:
    from engine import SamplingParams

    return llm.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))[0].outputs[0].text


def run(tmp_path: Path, source: Path, ids: list[str], *extra: str) -> tuple[list[dict], list[dict]]:
    output = tmp_path / "out"
    assert main(["run", str(source), "--output", str(output), "--database-url", f"sqlite:///{tmp_path / 'db'}",
                 *FAST, *extra]) == 0
    results, errors, _ = assert_each_id_once(open_store(str(output)), ids)
    return results, errors


def test_parquet_beam_rows_give_the_best_beam_beside_greedy_rows(reference, tmp_path: Path) -> None:
    source = write_parquet(tmp_path / "in.parquet", {"custom_id": ["w2", "w3", "plain"], "prompt": PROMPTS,
                                                     "beam_width": [2, 3, None]})
    results, errors = run(tmp_path, source, ["w2", "w3", "plain"])
    assert errors == []
    got = {r["custom_id"]: r["text"] for r in results}
    assert got == {"w2": best_beam(reference, PROMPTS[0], 2), "w3": best_beam(reference, PROMPTS[1], 3),
                   "plain": greedy(reference, PROMPTS[2])}
    assert got["w3"] != greedy(reference, PROMPTS[1]) or got["w2"] != greedy(reference, PROMPTS[0]), \
        "beam search found nothing greedy did not: the prompts do not tell them apart"


def completion_line(custom_id: str, prompt: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"prompt": prompt, **body}}


def test_openai_rows_need_the_jobs_consent_and_beams_do_not_sample(reference, tmp_path: Path) -> None:
    lines = [completion_line("beam", PROMPTS[0], beam_width=2), completion_line("hot", PROMPTS[1], beam_width=2,
                                                                                temperature=0.7)]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    _, refused = run(tmp_path / "refused", source, ["beam", "hot"])
    assert {e["custom_id"]: e["code"] for e in refused} == {"beam": "unsupported_parameter",
                                                              "hot": "unsupported_parameter"}
    assert "--allow-beam-search" in refused[0]["message"]
    results, errors = run(tmp_path / "allowed", source, ["beam", "hot"], "--allow-beam-search")
    assert [r["text"] for r in results] == [best_beam(reference, PROMPTS[0], 2)]
    assert [(e["custom_id"], e["code"]) for e in errors] == [("hot", "invalid_parameter")]
    assert "temperature" in errors[0]["message"]


def test_the_jobs_beam_width_runs_every_row_as_a_beam_search(reference, tmp_path: Path) -> None:
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(completion_line(f"r{i}", p)) + "\n" for i, p in enumerate(PROMPTS[:2])))
    results, errors = run(tmp_path, source, ["r0", "r1"], "--beam-width", "3")
    assert errors == []
    assert {r["custom_id"]: r["text"] for r in results} == {f"r{i}": best_beam(reference, p, 3)
                                                            for i, p in enumerate(PROMPTS[:2])}


def test_beam_params_from_rows_and_defaults() -> None:
    params = sampling_params({"max_tokens": 12, "temperature": 1.0, "seed": 3}, {"beam_width": 4, "n": 2})
    assert (params.beam_width, params.max_tokens) == (4, 12)  # the job's sampling defaults do not apply
    for bad, message in (({"beam_width": 2, "n": 3}, "n must be"), ({"beam_width": 2, "top_p": 0.5}, "top_p"),
                         ({"beam_width": 2, "logprobs": 2}, "logprobs"), ({"beam_width": 0}, "beam_width")):
        with pytest.raises(ValueError, match=message):
            sampling_params({}, bad)
