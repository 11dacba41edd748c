"""Simulated hosts for fault drills on a local stack: a `tokenmill worker` in its own UTS namespace (`unshare
-u`, then its own hostname), optionally with its clock moved by libfaketime (`LD_PRELOAD`, `FAKETIME`). To the
service it is another machine: another host, another clock; or, in a PID namespace of its own on a hostname
shared with others, a container with host networking. Used by the multi-host tests and `ops/soak_faults.py`;
needs root (or user namespaces) and the `libfaketime` package for a clock offset."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def faketime_env(offset: str) -> dict[str, str]:
    """Environment additions that move a process's clock by `offset` (libfaketime's syntax, e.g. "-60s")."""
    import libfaketime

    library = next(Path(libfaketime.__file__).parent.glob("vendor/**/libfaketime.so.1"))
    return {"LD_PRELOAD": str(library), "FAKETIME": offset}


def start_host_worker(state_dir: Path, model: str, host: str, log: Path, clock_offset: str | None = None,
                      env: dict[str, str] | None = None, worker_args: tuple[str, ...] = (), name: str | None = None,
                      own_pids: bool = False) -> subprocess.Popen:
    """`tokenmill worker --name NAME` (default: HOST) against the stack in `state_dir`, as host `host`, in a process
    group of its own (stop it with `os.killpg`); `own_pids`: in a PID namespace of its own too, where its
    supervisor is PID 1 (as in a container)."""
    environment = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO)}
    if clock_offset:
        environment.update(faketime_env(clock_offset))
    namespaces = ["-u", "--pid", "--fork", "--mount-proc"] if own_pids else ["-u"]
    command = ["unshare", *namespaces, "sh", "-c", f'hostname {host} && exec "$@"', "sh", sys.executable, "-m",
               "tokenmill", "worker", "--name", name or host, "--model", model, *worker_args, "--state-dir",
               str(state_dir)]
    with open(log, "ab") as output:
        return subprocess.Popen(command, env=environment, cwd=state_dir, stdout=output, stderr=subprocess.STDOUT,
                                start_new_session=True)
