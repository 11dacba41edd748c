"""ops/gpu_check.sh end to end in its CPU fallback (tiny model): it prints both tables and writes them as markdown.
The Triton tests it runs first are the suite's own (tests/engine/test_triton_*.py), so here it skips them, and only
its quick selection of them is checked to name tests that exist."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback; on CUDA run ops/gpu_check.sh itself")
def test_gpu_check_cpu_fallback_prints_tables(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the script sets it where needed
    try:  # about 40 s on a quiet 2-core machine; over 480 s once, in HF's 4.6 GB KV cache on a full machine
        proc = subprocess.run([str(ROOT / "ops" / "gpu_check.sh"), "--quick", "--skip-tests", "--out", str(tmp_path)],
                              cwd=tmp_path,
                              env={**env, "COLUMNS": "200"}, capture_output=True, text=True, timeout=480)
    except subprocess.TimeoutExpired as slow:
        said = [(part or b"").decode(errors="replace")[-3000:] for part in (slow.stdout, slow.stderr)]
        pytest.fail(f"gpu_check.sh --quick ran over 480 s; stdout ends:\n{said[0]}\nstderr ends:\n{said[1]}")
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "CPU fallback" in out
    assert "[PASS] throughput table" in out, out[-3000:]
    assert "test_triton" not in out  # skipped
    assert "throughput (useful generated tokens per second)" in out
    assert "decode step vs weights-read floor" in out
    for system in ("HF static batching", "HF continuous batching", "tokenmill"):
        assert system in out
    markdown = (tmp_path / "gpu_check.md").read_text()
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 2 + 3 + 2  # two headers, three systems, decode batch sizes 1 and 4
    assert "gpu check passed" in out


def test_gpu_check_quick_selection_names_tests_of_each_file():
    sys.path.insert(0, str(ROOT / "ops"))
    try:
        from gpu_check import QUICK_SELECTION
    finally:
        sys.path.remove(str(ROOT / "ops"))
    for path, selection in QUICK_SELECTION.items():
        listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                 "-k", selection, path], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0, listed.stdout[-2000:] + listed.stderr[-2000:]
        assert sum(line.startswith(path) for line in listed.stdout.splitlines()) >= 2, listed.stdout[-2000:]
