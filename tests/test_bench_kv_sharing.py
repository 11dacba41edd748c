"""`tokenmill bench kv-sharing`, tiny: one job of shared prefixes over two real Celery workers without and with
--kv-sharing (real model, the local Redis), both runs in the table with consistent counts, identical outputs."""

from __future__ import annotations

import re

import pytest

from tokenmill.cli import main

pytestmark = pytest.mark.real_model
NUMBER = r"([\d,.]+)"


def test_bench_kv_sharing_prints_both_runs_side_by_side(capsys) -> None:
    # 4 x 4 rows in shards of 2: enough shards that a worker meets prefixes the other computed (with 2 x 3 both
    # workers computed them at once, and nothing was loaded)
    code = main(["bench", "kv-sharing", "--prefixes", "4", "--questions", "4", "--prefix-tokens", "128",
                 "--max-tokens", "4", "--shard-size", "2", "--dtype", "float32"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert re.search(r"machine: .*flags: .*avx", printed), printed
    rows = {}
    for label in ("without", "with"):
        found = re.search(rf"│ {label}\s*│" + r"\s*│".join([rf"\s*{NUMBER}"] * 8), printed)
        assert found, printed
        rows[label] = [float(value.replace(",", "")) for value in found.groups()]
    for label, (computed, loaded, own, prompt, seconds, rate, _, workers) in rows.items():
        assert computed + loaded + own == prompt, (label, rows[label])  # every prompt token once: no preemption
        assert prompt >= 16 * 128 and seconds > 0 and rate > 0 and workers == 2
        assert loaded % 16 == 0
    assert rows["without"][1] == 0  # nothing loaded without sharing
    assert rows["with"][1] > 0 and rows["with"][0] < rows["without"][0]  # sharing saves prefill
    assert rows["without"][3] == rows["with"][3]
    saving = re.search(r"with KV sharing \(one run each\): (-?\d+)% fewer prefill tokens computed, [\d.]+x the "
                       r"tok/s .*; 0 store errors; outputs identical", printed)
    assert saving and int(saving.group(1)) > 0, printed
    stored = re.search(r"│ with\s*│.*│\s*(\d+) MiB\s*│", printed)
    assert stored and int(stored.group(1)) > 0, printed


def test_bench_kv_sharing_refuses_counts_below_one(capsys) -> None:
    assert main(["bench", "kv-sharing", "--repeats", "0"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err
