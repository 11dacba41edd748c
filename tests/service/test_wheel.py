"""The stack runs from an installed package: build a wheel, install it into a fresh virtualenv outside the
checkout, and run `tokenmill stack up --workers 1`, one job via Kafka, and `tokenmill stack down` from there.

Installing every dependency from scratch would take many minutes, so the fresh virtualenv (same base
interpreter) sees this environment's site-packages through a .pth line: a plain path line, so the editable
install's finder (a .pth hook of its own) is not run, and `tokenmill` and its packages come from the wheel
alone. The test checks that they do."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.fixtures_services import free_port_block

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tokenmill", "engine", "storage", "ingest", "workers", "migrations")


def run(command: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n" \
                                 f"{done.stderr[-4000:]}"
    return done


def build_wheel(work: Path) -> Path:
    """A wheel of the working tree (copied first, so the build leaves nothing in the checkout)."""
    source = work / "src"
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):  # what git would ship: no venvs, caches or build outputs, however large
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
         "-w", str(work / "dist"), str(source)], timeout=300)
    (wheel,) = (work / "dist").glob("tokenmill-*.whl")
    return wheel


def fresh_venv(work: Path, wheel: Path) -> Path:
    """A new virtualenv with the wheel installed; this environment's site-packages lend the dependencies."""
    target = work / "venv"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(target)
    python = target / "bin" / "python"
    purelib = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                  timeout=60).stdout.strip()
    Path(purelib, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q", str(wheel)],
        timeout=300, env=clean_env(), cwd=work)
    return target


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without what points at the checkout or at another stack (its random S3 keys, any
    TOKENMILL_ setting an earlier test left in this process)."""
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    return {**{k: v for k, v in os.environ.items() if k not in dropped and not k.startswith("TOKENMILL_")}, **extra}


def test_the_stack_runs_from_a_wheel_in_a_fresh_virtualenv(tmp_path_factory, pg_databases) -> None:
    work = tmp_path_factory.mktemp("wheel")
    target = fresh_venv(work, build_wheel(work))
    python, tokenmill = str(target / "bin" / "python"), str(target / "bin" / "tokenmill")
    env = clean_env(COLUMNS="200")

    where = json.loads(run([python, "-c", f"import json, {', '.join(PACKAGES)}; print(json.dumps("
                                          f"[m.__file__ for m in ({', '.join(PACKAGES)})]))"],
                           timeout=60, env=env, cwd=work).stdout)
    assert all(Path(path).is_relative_to(target) for path in where), where

    state_dir = work / "stack"
    mine = ["--state-dir", str(state_dir)]
    inputs = work / "prompts.parquet"
    pq.write_table(pa.table({"custom_id": ["a", "b", "c"], "prompt": ["Hello", "One, two,", "The sky is"]}), inputs)
    database = pg_databases()
    run([tokenmill, "stack", "up", "--workers", "1", "--port-base", str(free_port_block(24)), "--database-url",
         database, "--threads", "1", "--kv-cache-memory", "0.25", *mine], timeout=240, env=env, cwd=work)
    try:
        state = json.loads((state_dir / "stack.json").read_text())
        assert set(state["processes"]) == {"redis", "kv-redis", "worker1", "beat", "flower", "consumer", "watcher",
                                           "api"}
        submitted = run([tokenmill, "submit", str(inputs), "--via", "kafka", "--max-tokens", "4", "--wait",
                         "--timeout", "180", *mine], timeout=240, env=env, cwd=work)
        job_id = submitted.stdout.strip().splitlines()[-1]
        status = json.loads(run([tokenmill, "status", job_id, "--json", "--database-url", database], timeout=60,
                                env=env, cwd=work).stdout)["job"]
        assert status["status"] == "completed" and status["requests_completed"] == 3, status
        assert status["settings"]["executor"] == "celery" and status["source"] == "kafka"
    finally:
        down = subprocess.run([tokenmill, "stack", "down", *mine], capture_output=True, text=True, timeout=180,
                              env=env, cwd=work)
    assert down.returncode == 0, f"stack down reported problems:\n{down.stdout}\n{down.stderr}"
