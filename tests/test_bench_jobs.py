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
