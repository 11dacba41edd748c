"""The explorer's engine: no model, its text a function of the row, so a duplicated or missing row shows. It stands
in for the worker process's engine service (`SimWorkerProcess`, in place of `workers.worker_engine.WorkerProcess`:
the seam every shard runs through), and running a shard's rows is a seam of its own: simulated time passes, and
the worker may crash or pause there."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from storage.formats import Request, RowError
from workers.leases import HeldHere
from workers.shards import ShardOutcome

ROW_SECONDS = 1.5  # simulated engine time per row


def expected_text(custom_id: str) -> str:
    return "echo-" + hashlib.sha256(custom_id.encode()).hexdigest()[:16]


def fails(custom_id: str) -> bool:
    """Rows the engine fails (an engine_error in the error file), one in about eleven."""
    return int(hashlib.sha256(custom_id.encode()).hexdigest(), 16) % 11 == 0


@dataclass(frozen=True)
class SimSpec:
    kv_role: str | None = None
    lora_modules: dict[str, str] = field(default_factory=dict)


@dataclass
class SimWorkerProcess:
    """Stands for every simulated worker's `WorkerProcess`: the `SimEngineLoop`, and what they hold now."""

    loop: SimEngineLoop
    held: HeldHere = field(default_factory=HeldHere)
    spec: SimSpec = field(default_factory=SimSpec)

    def engine_loop(self, job_model: str | None = None) -> SimEngineLoop:
        return self.loop


class SimEngineLoop:
    def __init__(self, seam: Callable[..., None], row_seconds: float = ROW_SECONDS) -> None:
        self.seam, self.row_seconds = seam, row_seconds

    def run(self, settings, rows: list, prefix: str, should_stop: Callable[[], bool] = lambda: False,
            progress=None) -> ShardOutcome:
        self.seam("engine", duration=self.row_seconds * max(1, len(rows)))
        if should_stop():
            return ShardOutcome(cancelled=True)
        outcome = ShardOutcome()
        for row in rows:
            if isinstance(row, RowError):
                outcome.errors.append(row)
            elif isinstance(row, Request) and fails(row.custom_id):
                outcome.errors.append(RowError(row.row, row.custom_id, "engine_error", "simulated engine error"))
            else:
                outcome.records.append({
                    "custom_id": row.custom_id, "text": expected_text(row.custom_id), "finish_reason": "stop",
                    "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0, "ttft_ms": None,
                    "latency_ms": None, "row_index": row.row, "endpoint": row.endpoint, "logprobs": None,
                    "choice_index": 0})
        if progress is not None:
            progress.advance(len(rows), 2 * len(outcome.records))
        return outcome

    def close(self, timeout_s: float = 30) -> None:
        return None
