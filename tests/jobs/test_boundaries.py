"""storage/ must not import torch or the engine; workers/ loads them only when a job needs the model."""

from __future__ import annotations

import subprocess
import sys

MODULES = ["storage.db", "storage.models", "storage.states", "storage.repository", "storage.objectstore",
           "storage.formats", "storage.migrate", "migrations", "workers.inprocess"]


def test_storage_and_job_api_import_without_torch() -> None:
    code = (f"import sys; import {', '.join(MODULES)}; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', 'transformers')); "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"imported: {result.stdout} {result.stderr[-2000:]}"
