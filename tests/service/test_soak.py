"""The soak harness (ops/soak_faults.py) on the test stack, short: two jobs (one via Kafka, one via the S3 inbox)
and seven faults named in order (Redis restarted, the stack's own PostgreSQL restarted, a worker pausing itself
past its lease between noting its part and the PUT, a worker killed, PostgreSQL partitioned past the lease without
a restart, a worker killing itself in the middle of a finalize, a running job cancelled), each injected once a soak
job has running work, then every job's outputs checked row by row. Longer runs, with
simulated hosts, are in docs/service.md."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.fixtures_services import REPO

pytestmark = pytest.mark.real_model

FAULTS = ("redis-restart", "postgres-restart", "pause-worker-upload", "kill-worker", "postgres-partition",
          "kill-during-finalize", "cancel-job")
ON_RUNNING_SHARDS = len(FAULTS) - 1  # killing a finalize step is no hit on a running shard


def test_a_short_soak_under_faults_loses_and_duplicates_nothing(stack) -> None:
    run = subprocess.run([sys.executable, str(REPO / "ops" / "soak_faults.py"), "--state-dir", str(stack.dir),
                          "--jobs", "2", "--rows", "12", "--fault-list", ",".join(FAULTS), "--seed", "3",
                          "--min-hits", str(ON_RUNNING_SHARDS), "--timeout", "400"],
                         cwd=REPO, env=stack.env, capture_output=True, text=True, timeout=900)
    print(run.stdout)
    stack.reload()  # the processes it restarted
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"faults injected: {len(FAULTS)}" in run.stdout
    assert "postgres-partition x1" in run.stdout and "pause-worker-upload x1" in run.stdout
    # each fault waited for running work, and the database, asked just before, still showed it
    assert f"faults that hit running work: {ON_RUNNING_SHARDS} of {len(FAULTS)}" in run.stdout
    assert re.search(r"crash at during_finalize: process \d+ of worker\d, restarted", run.stdout), run.stdout[-3000:]
    assert re.search(r"pause at before_part_upload: process \d+ of worker\d", run.stdout), run.stdout[-3000:]
    jobs = re.search(r"jobs completed: (\d+) of (\d+)", run.stdout)  # the cancelled one may have ended first
    assert jobs and int(jobs[1]) >= int(jobs[2]) - 1 and int(jobs[2]) >= 2, run.stdout[-3000:]
    for figure in ("rows lost: 0", "rows duplicated: 0", "part files outside a manifest: 0",
                   "jobs that ended otherwise than completed: 0"):
        assert figure in run.stdout
