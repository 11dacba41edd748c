"""`tokenmill bench kv-sharing`, tiny: one job of shared prefixes over two real Celery workers without and with
--kv-sharing (real model, the local Redis), both runs in the table with consistent counts, identical outputs."""

from __future__ import annotations

import re

import pytest

from tokenmill.cli import main

pytestmark = pytest.mark.real_model
NUMBER = r"([\d,.]+)"


def test_bench_kv_sharing_prints_both_runs_side_by_side(capsys) -> None:
    code = main(["bench", "kv-sharing", "--prefixes", "2", "--questions", "3", "--prefix-tokens", "512",
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
        assert prompt >= 6 * 512 and seconds > 0 and rate > 0 and workers == 2
        assert loaded % 16 == 0
    assert rows["without"][1] == 0  # nothing loaded without sharing
    assert rows["without"][3] == rows["with"][3]
    assert re.search(r"with KV sharing \(one run each\): -?\d+% fewer prefill tokens computed, [\d.]+x the tok/s "
                     r".*; 0 store errors; outputs identical", printed), printed
    stored = re.search(r"│ with\s*│.*│\s*(\d+) MiB\s*│", printed)
    assert stored and int(stored.group(1)) > 0, printed


def test_bench_kv_sharing_refuses_counts_below_one(capsys) -> None:
    assert main(["bench", "kv-sharing", "--repeats", "0"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err
