"""`tokenmill bench embed` end to end on a few sentences: tokenmill, sentence-transformers (default and best batch
size) and vLLM's row (here: not installed) in one table, with the CPU flags, tokenmill's ratio and the cosines; on
CPUs with AMX also tokenmill's float32 with matmul precision "high"."""

from __future__ import annotations

import json

import pytest

from tokenmill.bench.embed import MATMUL_HIGH, matmul_high_runs
from tokenmill.cli import main

pytestmark = pytest.mark.real_model


def test_bench_embed_prints_every_system_side_by_side(tmp_path, capsys):
    out = tmp_path / "embed.json"
    code = main(["bench", "embed", "--num-sentences", "64", "--dtypes", "float32", "--threads", "2",
                 "--vllm-venv", str(tmp_path / "no-venv"), "--json", str(out)])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0, printed
    assert "machine: " in printed and " cores, flags: " in printed
    assert "embedding throughput: 64 held-out sentences" in printed
    data = json.loads(out.read_text())
    rows = {r["system"]: r for r in data["results"]}
    high = [MATMUL_HIGH] if matmul_high_runs() else []
    assert list(rows) == ["tokenmill", *high, "sentence-transformers", "sentence-transformers best", "vLLM"]
    assert rows["vLLM"]["seconds"] is None and "not installed" in rows["vLLM"]["note"]
    assert rows["sentence-transformers best"]["seconds"] <= rows["sentence-transformers"]["seconds"]
    assert all(rows[name]["min_cosine"] >= 0.9999 for name in ("sentence-transformers", "sentence-transformers best"))
    assert all(rows[name]["min_cosine"] >= 0.99999 for name in high)  # against tokenmill's "highest" vectors
    assert rows["tokenmill"]["sentences"] == 64 and rows["tokenmill"]["tokens"] > 64 * 5
    others = [r["sentences"] / r["seconds"] for name, r in rows.items() if r["seconds"] and "tokenmill" not in name]
    for name in ["tokenmill", *high]:
        ours = rows[name]["sentences"] / rows[name]["seconds"]
        assert f"{ours / max(others):.2f}x" in printed, name
    assert "x best other" in printed


def test_bench_embed_skips_bfloat16_on_a_cpu_without_native_bfloat16(monkeypatch, capsys):
    monkeypatch.setattr("engine.model_loader.cpu_has_native_bf16", lambda: False)
    code = main(["bench", "embed", "--num-sentences", "8", "--dtypes", "bfloat16", "--threads", "2"])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0, printed
    assert "bfloat16 skipped: this CPU has no native bfloat16" in printed
    assert "embedding throughput" not in printed


def test_a_vllm_that_dies_at_start_is_run_once_more_and_the_table_says_so(monkeypatch, tmp_path):
    import numpy as np

    from tokenmill.bench import embed, vllm_compare

    outcomes = [(embed.EmbedResult("vLLM", "float32", None, 2, 9, "failed to run: terminate called"), None),
                (embed.EmbedResult("vLLM", "float32", 1.0, 2, 9, "vLLM 0.32.0 (start-up 40 s)"), np.ones((2, 4)))]
    monkeypatch.setattr(vllm_compare, "vllm_python", lambda venv: tmp_path / "python")
    monkeypatch.setattr(embed, "_run_vllm_once", lambda *args: outcomes.pop(0))
    result, vectors = embed.run_vllm(tmp_path, ["a", "b"], "float32", 2, 9, None)
    assert vectors is not None and result.seconds == 1.0
    assert result.note == "vLLM 0.32.0 (start-up 40 s); run again after: terminate called"
    outcomes[:] = [(embed.EmbedResult("vLLM", "float32", None, 2, 9, f"failed to run: {n}"), None) for n in "xy"]
    result, vectors = embed.run_vllm(tmp_path, ["a", "b"], "float32", 2, 9, None)
    assert vectors is None and result.note == "failed to run: y" and not outcomes
