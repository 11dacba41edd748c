"""`tokenmill bench throughput`'s plots (drawn in the short run of tests/test_cli.py: `assert_plots`), its refusal
of a bad sweep, and `--against vllm` without vLLM's venv."""

from __future__ import annotations

import pytest
from matplotlib.image import imread

from tokenmill.cli import main

pytestmark = pytest.mark.real_model

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_plots(plots, printed: str) -> None:
    """The sweep's defaults follow the workload (batch 1 and 4, 8 tokens); both PNGs drawn at their sizes."""
    assert "decode throughput against concurrency" in printed
    assert "8 prompt + 8 output tokens per request at batch 1, 4 ..." in printed
    for name, (width, height) in {"throughput_concurrency.png": (990, 605),
                                  "latency_distributions.png": (1210, 495)}.items():
        path = plots / name
        assert str(path) in printed.replace("\n", "")
        assert path.read_bytes()[:8] == PNG_SIGNATURE and path.stat().st_size > 20_000, name
        pixels = imread(path)
        assert pixels.shape[:2] == (height, width), name
        assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()}) > 50, name  # drawn on


def test_a_bad_sweep_is_refused_before_anything_runs(capsys):
    assert main(["bench", "throughput", "--sweep-tokens", "1"]) == 2
    assert "--sweep-tokens >= 2" in capsys.readouterr().err


def test_against_vllm_without_its_venv_says_how_to_build_it_and_runs_the_rest(tmp_path, capsys):
    code = main(["bench", "throughput", "--num-prompts", "2", "--min-tokens", "2", "--max-tokens", "3",
                 "--dtypes", "float32", "--systems", "tokenmill", "--threads", "2", "--no-plots",
                 "--against", "vllm", "--vllm-venv", str(tmp_path / "no-venv"), "--batch1-tokens", "4",
                 "--plots", str(tmp_path / "plots")])
    printed = capsys.readouterr().out.replace("\n", " ")
    assert code == 0, printed
    assert "vLLM is not installed: run `make vllm-venv`" in printed
    assert "machine: " in printed and " cores, flags: " in printed
    assert "throughput (useful generated tokens per second)" in printed
    assert "batch 1: time per output token" in printed and "x vLLM" in printed
    assert not (tmp_path / "plots").exists()  # --no-plots wins over --plots


def test_the_batch_1_table_says_how_many_times_faster_than_vllm():
    from rich.console import Console

    from tokenmill.bench.tables import batch1_table

    console = Console(width=200, record=True)
    console.print(batch1_table([("tokenmill", "bfloat16", 0.0164), ("vLLM", "bfloat16", 0.032)], 128))
    rows = {line.split("│")[1].strip(): line for line in console.export_text().splitlines() if "bfloat16" in line}
    assert "16.4" in rows["tokenmill"] and "1.95x" in rows["tokenmill"] and "1.00x" in rows["vLLM"]
