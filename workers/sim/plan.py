"""What a run's scenario says about one job: its rows, its settings, when it arrives and is cancelled; filled in
as the run goes (its id, when it arrived and expired)."""

from __future__ import annotations

from dataclasses import dataclass

from ingest.policy import API_RESULTS

BUCKET = "s3://sim"
API_BUCKET = f"{BUCKET}/api"


@dataclass
class JobPlan:
    index: int
    rows: int
    shard_size: int
    window: str
    arrives_at: float
    openai_output: bool
    job_id: str | None = None
    cancel_at: float | None = None
    api: bool = False  # a batch of the OpenAI Batch API (`workers.sim.api`)
    output_expires_after: int | None = None  # the API batch's result files' lifetime
    prefix_of: int | None = None  # writes to this earlier job's output prefix
    rejected: str | None = None  # why the front door refused it
    requested_at: float | None = None  # true time its request began (an API call may pause before answering)
    arrived_at: float | None = None  # true (database) time its request was answered
    expired_at: float | None = None  # true time of the sweep that expired it

    @property
    def custom_ids(self) -> list[str]:
        return [f"j{self.index}-r{row:03d}" for row in range(self.rows)]

    @property
    def input_uri(self) -> str:
        return f"{BUCKET}/inbox/job-{self.index}.parquet"

    @property
    def output_uri(self) -> str:
        if self.api:
            return f"{API_BUCKET}/{API_RESULTS}/{self.job_id}"
        return f"{BUCKET}/out/job-{self.index if self.prefix_of is None else self.prefix_of}"
