"""Jobs, shards and row errors, plus the `job_status` view.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

View `job_status`: one row per job, for people and dashboards.

| column | meaning |
|---|---|
| job_id, status, source, model, input_uri, output_uri, error | as in `jobs` |
| requests_total | input rows (requests) in the job, known once validation passed |
| requests_completed, requests_failed | rows with an output / rows in the error file, over completed shards |
| progress | (completed + failed) / total, 0..1 (0 while the total is unknown) |
| shards_total, shards_completed | shard counts |
| prompt_tokens, completion_tokens, cached_tokens | token totals over completed shards |
| created_at | when the job was submitted |
| started_at | when it last went `in_progress` |
| finished_at | when it reached its current final status (completed, failed, cancelled, expired); NULL while live |
| duration_s | started_at to finished_at (or to now while running), seconds |
| tokens_per_s | completion_tokens / duration_s: generated tokens per second |
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

JOB_STATUSES = ("validating", "queued", "in_progress", "finalizing", "completed", "failed", "cancelling",
                "cancelled", "expired")
SHARD_STATUSES = ("pending", "running", "completed", "failed", "cancelled")
SOURCES = ("kafka", "s3", "cli", "schedule")
ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")  # SQLite only auto-increments INTEGER keys


def one_of(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def timestamp(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def counter(name: str, type_: sa.types.TypeEngine | None = None) -> sa.Column:
    return sa.Column(name, type_ or sa.BigInteger(), nullable=False)


def create_jobs() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("idempotency_key", sa.String(255), nullable=False),
        sa.Column("source", sa.String(16), nullable=False),
        sa.Column("source_ref", sa.Text(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("model", sa.String(512), nullable=False),
        sa.Column("input_uri", sa.Text(), nullable=False),
        sa.Column("output_uri", sa.Text(), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        *(counter(name) for name in ("requests_total", "requests_completed", "requests_failed",
                                     "prompt_tokens", "completion_tokens", "cached_tokens")),
        timestamp("created_at", nullable=False),
        timestamp("expires_at"),
        *(timestamp(f"{status}_at") for status in JOB_STATUSES),
        sa.CheckConstraint(one_of("source", SOURCES), name=op.f("ck_jobs_source")),
        sa.CheckConstraint(one_of("status", JOB_STATUSES), name=op.f("ck_jobs_status")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
        sa.UniqueConstraint("idempotency_key", name=op.f("uq_jobs_idempotency_key")),
    )
    op.create_index(op.f("ix_jobs_created_at"), "jobs", ["created_at"])
    op.create_index(op.f("ix_jobs_status"), "jobs", ["status"])


def create_shards() -> None:
    op.create_table(
        "shards",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("row_start", sa.BigInteger(), nullable=False),
        sa.Column("row_end", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(255), nullable=True),
        timestamp("lease_expires_at"),
        timestamp("started_at"),
        timestamp("finished_at"),
        counter("rows_completed", sa.Integer()),
        counter("rows_failed", sa.Integer()),
        *(counter(name) for name in ("prompt_tokens", "completion_tokens", "cached_tokens")),
        sa.Column("output_key", sa.String(1024), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.CheckConstraint(one_of("status", SHARD_STATUSES), name=op.f("ck_shards_status")),
        sa.CheckConstraint("row_end >= row_start", name=op.f("ck_shards_row_range")),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_shards_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_shards")),
        sa.UniqueConstraint("job_id", "index", name=op.f("uq_shards_job_id_index")),
    )
    op.create_index(op.f("ix_shards_job_id"), "shards", ["job_id"])


def create_row_errors() -> None:
    op.create_table(
        "row_errors",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("shard", sa.Integer(), nullable=False),
        sa.Column("row_index", sa.BigInteger(), nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=True),
        sa.Column("code", sa.String(64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_row_errors_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_row_errors")),
        sa.UniqueConstraint("job_id", "row_index", name=op.f("uq_row_errors_job_id_row_index")),
    )
    op.create_index("ix_row_errors_job_id_shard", "row_errors", ["job_id", "shard"])


def seconds_between(start: str, end: str) -> str:
    """SQL for end - start in seconds (float) on the current dialect."""
    if op.get_bind().dialect.name == "sqlite":
        return f"((julianday({end}) - julianday({start})) * 86400.0)"
    return f"CAST(EXTRACT(EPOCH FROM ({end} - {start})) AS DOUBLE PRECISION)"


def job_status_view() -> str:
    now = "CURRENT_TIMESTAMP"
    finished = ("CASE j.status WHEN 'completed' THEN j.completed_at WHEN 'failed' THEN j.failed_at "
                "WHEN 'cancelled' THEN j.cancelled_at WHEN 'expired' THEN j.expired_at END")
    duration = seconds_between("j.in_progress_at", f"COALESCE({finished}, {now})")
    return f"""
CREATE VIEW job_status AS
SELECT
    j.id AS job_id, j.status, j.source, j.model, j.input_uri, j.output_uri,
    j.requests_total, j.requests_completed, j.requests_failed,
    CASE WHEN j.requests_total > 0
         THEN CAST(j.requests_completed + j.requests_failed AS DOUBLE PRECISION) / j.requests_total
         ELSE 0.0 END AS progress,
    COALESCE(s.shards_total, 0) AS shards_total,
    COALESCE(s.shards_completed, 0) AS shards_completed,
    j.prompt_tokens, j.completion_tokens, j.cached_tokens,
    j.created_at, j.in_progress_at AS started_at, {finished} AS finished_at,
    CASE WHEN j.in_progress_at IS NOT NULL THEN {duration} END AS duration_s,
    CASE WHEN j.in_progress_at IS NOT NULL AND {duration} > 0
         THEN j.completion_tokens / {duration} END AS tokens_per_s,
    j.error
FROM jobs j
LEFT JOIN (
    SELECT job_id, COUNT(*) AS shards_total,
           SUM(CASE WHEN status = 'completed' THEN 1 ELSE 0 END) AS shards_completed
    FROM shards GROUP BY job_id
) s ON s.job_id = j.id
"""


def upgrade() -> None:
    create_jobs()
    create_shards()
    create_row_errors()
    op.execute(job_status_view())


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS job_status")
    op.drop_table("row_errors")
    op.drop_table("shards")
    op.drop_table("jobs")
