"""Running seeds: each one a fresh database and a fresh simulated fleet; a failing seed keeps its fault schedule
and the command that replays it."""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from workers.sim.world import Database, Outcome, World


def run_seed(seed: int, workers: int = 3, database: Database | None = None) -> Outcome:
    own = database is None
    database = database or Database(None)
    try:
        return World(seed, workers, database.fresh()).run()
    finally:
        if own:
            database.close()


# settings read from the environment that change what a seed does: a replay needs the same
REPLAY_ENV = ("TOKENMILL_LEASE_S", "TOKENMILL_OUTAGE_WAIT_S")


def replay_command(seed: int, workers: int, database_url: str | None) -> str:
    env = "".join(f"{name}={shlex.quote(os.environ[name])} " for name in REPLAY_ENV if os.environ.get(name))
    url = f" --database-url {shlex.quote(database_url)}" if database_url else ""
    return f"{env}tokenmill sim --seed {seed} --workers {workers}{url}"


@dataclass
class Summary:
    runs: int = 0
    failures: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    last: Outcome | None = None

    @property
    def runs_per_s(self) -> float:
        return self.runs / self.seconds if self.seconds else 0.0

    def line(self) -> str:
        return f"runs={self.runs} violations={len(self.failures)} runs/s={self.runs_per_s:.1f}"


def explore(seeds: Iterable[int], workers: int = 3, database_url: str | None = None,
            on_outcome: Callable[[Outcome], None] | None = None) -> Summary:
    summary, started = Summary(), time.perf_counter()
    database = Database(database_url)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # one simulated task thread runs at a time: hand the turn over at once
    try:
        for seed in seeds:
            outcome = run_seed(seed, workers, database)
            summary.runs += 1
            summary.last = outcome
            if not outcome.ok:
                summary.failures.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
    finally:
        sys.setswitchinterval(switch)
        database.close()
    summary.seconds = time.perf_counter() - started
    return summary


def report(outcome: Outcome, workers: int, database_url: str | None) -> str:
    lines = [f"seed {outcome.seed}: {len(outcome.violations)} violation(s) after {outcome.simulated_s:.0f} s "
             f"simulated", *(f"  {v}" for v in outcome.violations), "  fault schedule:",
             *(f"    {entry}" for entry in outcome.schedule), f"  job statuses: {outcome.statuses}"]
    if outcome.task_errors:
        lines += ["  task errors:", *(f"    {e}" for e in outcome.task_errors[:10])]
    lines.append(f"  replay: {replay_command(outcome.seed, workers, database_url)}")
    return "\n".join(lines)
