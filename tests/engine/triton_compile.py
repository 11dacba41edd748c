"""Compile a module's Triton kernels for sm_90 in a fresh process without the interpreter: what the CPU interpreter
does not check (types, tl.dot shapes, resources)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOPPER_SHARED_BYTES = 227 * 1024  # per thread block, opted in


def hopper_shared_bytes(module: str, arguments: list[str]) -> list[int]:
    """The most shared memory any kernel of `module` takes, per `compile_for(90, *args)` argument list (Python
    source text, `torch` imported)."""
    script = (f"import torch\nfrom {module} import compile_for\nfor args in [{', '.join(arguments)}]:\n"
              "    print(max(compile_for(90, *args).values()))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [int(line) for line in proc.stdout.split()]
