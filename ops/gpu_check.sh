#!/usr/bin/env bash
# One-shot check of the GPU path: Triton kernel tests against the torch reference, greedy identity with the
# Triton backend, a bf16 throughput table (tokenmill vs Hugging Face static and continuous batching) and decode-step
# time against the weights-read floor. Installs and downloads nothing; runs the machine's own python3 with torch
# (or .venv's, if there is one). Without CUDA it runs a small CPU fallback of the same steps.
#   ops/gpu_check.sh [--quick] [--out DIR] [--model NAME_OR_DIR] [--num-prompts N] [--skip-tests]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then
    python=.venv/bin/python
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec "$python" ops/gpu_check.py "$@"
