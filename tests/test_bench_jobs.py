"""`tokenmill bench jobs`: the same rows as one shard and as small shards through the job runner, real model."""

from __future__ import annotations

import re

import pytest

from tokenmill.cli import main

pytestmark = pytest.mark.real_model


def test_bench_jobs_prints_both_runs_the_ratio_and_identical_outputs(capsys):
    # float32: in bf16, near-ties between tokens can go either way with the batch order, which sharding changes
    code = main(["bench", "jobs", "--num-rows", "6", "--shard-size", "2", "--min-tokens", "2", "--max-tokens", "6",
                 "--threads", "2", "--kv-cache-memory", "0.25", "--dtype", "float32"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "machine: " in printed and "one-shard" in printed and "shards-of-2" in printed
    runs = re.findall(r"(one-shard|shards-of-2)\s*│\s*(\d+)\s*│\s*[\d.]+\s*│\s*(\d+)", printed)
    assert [(label, int(shards)) for label, shards, _ in runs] == [("one-shard", 1), ("shards-of-2", 3)]
    assert runs[0][2] == runs[1][2] and 6 * 2 <= int(runs[0][2]) <= 6 * 6
    assert re.search(r"shards of 2: \d+% of one shard's completion tok/s \(target >= 90%\); outputs identical",
                     printed)


def test_bench_jobs_refuses_a_shard_larger_than_the_job(capsys):
    assert main(["bench", "jobs", "--num-rows", "4", "--shard-size", "8"]) == 2
    assert "--shard-size between 1 and --num-rows" in capsys.readouterr().err


def test_bench_jobs_against_engine_prints_both_rates_the_ratio_and_rss(capsys):
    code = main(["bench", "jobs", "--against-engine", "--num-rows", "12", "--shard-size", "5", "--tiny-model",
                 "--sampling", "default", "--repeats", "2", "--threads", "1", "--dtype", "float32"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "12 one-token chat rows, default sampling" in printed
    alone = re.findall(r"engine alone \(LLM\.chat\)\s+([\d.]+) rows/s .*peak RSS (\d+) MiB", printed)
    job = re.findall(r"tokenmill run \(run-\d\)\s+([\d.]+) rows/s .*peak RSS (\d+) MiB", printed)
    assert len(alone) == len(job) == 2 and all(float(rate) > 0 and int(rss) > 0 for rate, rss in alone + job)
    assert len(re.findall(r"job path: \d+% of the engine alone's rows/s \(target >= 90%\); its validation and "
                          r"planning [\d.]+ s, finalize [\d.]+ s", printed)) == 2
    assert re.search(r"best of 2: engine alone [\d.]+ rows/s, job [\d.]+ rows/s: \d+%", printed)


def test_bench_jobs_memory_runs_each_size_in_a_fresh_process(capsys):
    code = main(["bench", "jobs", "--memory", "6,30", "--shard-size", "4", "--tiny-model", "--threads", "1",
                 "--dtype", "float32"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    sizes = re.findall(r"^\s+(\d+) rows:\s+[\d.]+ rows/s, finalize [\d.]+ s, peak RSS (\d+) MiB", printed, re.M)
    assert [int(rows) for rows, _ in sizes] == [6, 30] and all(int(rss) > 100 for _, rss in sizes)
    assert re.search(r"peak RSS of 30 rows against 6: [+-][\d.]+% \(target <= \+10%\); finalize [\d.]+ s", printed)


def test_bench_jobs_refuses_default_sampling_outside_the_engine_comparison(capsys):
    assert main(["bench", "jobs", "--sampling", "default"]) == 2
    assert "--sampling default is for --against-engine and --memory" in capsys.readouterr().err
