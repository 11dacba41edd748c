"""`pip install tokenmill` is the engine and `tokenmill run`; the service's libraries come with `tokenmill[service]`
(pyproject.toml), and a command that needs one it lacks says which extra to install."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tokenmill.cli import EXTRA_OF_MODULE

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# runs the command with the extras' modules missing, as in an environment that installed only the core
WITHOUT_EXTRAS = """
import sys
from importlib.abc import MetaPathFinder
missing = set(sys.argv[1].split(","))
class Missing(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
from tokenmill.cli import main
code = main(sys.argv[2:])
print("imported:", sorted(m for m in missing if m in sys.modules))
sys.exit(code)
"""


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower() for requirement in requirements}


def test_the_core_dependencies_hold_none_of_the_services():
    core = requirement_names(PROJECT["dependencies"])
    service = requirement_names(PROJECT["optional-dependencies"]["service"])
    assert {"torch", "sqlalchemy", "pyarrow"} <= core
    assert {"celery", "boto3", "fastapi", "psycopg", "kafka-python"} <= service
    assert not core & service
    assert "tokenmill[service,bench]" in PROJECT["optional-dependencies"]["dev"]  # `make setup` installs it all


def run_without_extras(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, ",".join(EXTRA_OF_MODULE), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.real_model
def test_tokenmill_run_needs_no_extra(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"custom_id": ["a", "b"], "prompt": ["Hello", "Name a colour."]}), tmp_path / "in.parquet")
    proc = run_without_extras("run", "in.parquet", "--output", "out", "--max-tokens", "2", "--database-url",
                              "sqlite:///jobs.db", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "2 completed, 0 failed" in proc.stdout and "imported: []" in proc.stdout


def test_a_service_command_without_the_extra_names_it(tmp_path):
    proc = run_without_extras("submit", "in.parquet", "--via", "kafka", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "pip install 'tokenmill[service]'" in proc.stderr
