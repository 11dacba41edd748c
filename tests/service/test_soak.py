"""The soak harness (ops/soak_faults.py) on the test stack, short: two jobs (one via Kafka, one via the S3 inbox)
and three faults drawn from its list by seed 3 (Redis restarted, a worker and the consumer killed), then every
job's outputs checked row by row. Longer runs, with simulated hosts, are in the README."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures_services import REPO

pytestmark = pytest.mark.real_model


def test_a_short_soak_under_faults_loses_and_duplicates_nothing(stack) -> None:
    run = subprocess.run([sys.executable, str(REPO / "ops" / "soak_faults.py"), "--state-dir", str(stack.dir),
                          "--jobs", "2", "--rows", "6", "--faults", "3", "--seed", "3", "--timeout", "400"],
                         cwd=REPO, env=stack.env, capture_output=True, text=True, timeout=600)
    print(run.stdout)
    stack.reload()  # the processes it restarted
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "faults injected: 3" in run.stdout and "jobs completed: 2 of 2" in run.stdout
    for figure in ("rows lost: 0", "rows duplicated: 0", "part files outside a manifest: 0"):
        assert figure in run.stdout
