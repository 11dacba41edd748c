"""The service around jobs: schedules and their runs, rejected Kafka messages, objects seen in the S3 inbox.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-06

- `schedules`: recurring jobs fired by Celery beat (name, cron, input/output patterns with `{date}`, model,
  job settings).
- `schedule_runs`: the job a schedule made for a date; UNIQUE (schedule_id, run_date) keeps it to one.
- `rejected_messages`: job-topic messages that were not JSON or not a valid job spec, with their
  topic/partition/offset and the error.
- `inbox_objects`: objects seen under the S3 inbox, by (bucket, key, etag), with the job each became.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def id_column() -> sa.Column:
    return sa.Column("id", ID, autoincrement=True, nullable=False)


def timestamp(name: str) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=False)


def job_reference(table: str) -> list:
    return [sa.Column("job_id", sa.String(36), nullable=True),
            sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f(f"fk_{table}_job_id_jobs"),
                                    ondelete="SET NULL")]


def upgrade() -> None:
    op.create_table(
        "schedules",
        id_column(),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("cron", sa.String(255), nullable=False),
        sa.Column("input_pattern", sa.Text(), nullable=False),
        sa.Column("output_pattern", sa.Text(), nullable=False),
        sa.Column("model", sa.String(512), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        timestamp("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_schedules")),
        sa.UniqueConstraint("name", name=op.f("uq_schedules_name")),
    )
    op.create_table(
        "schedule_runs",
        id_column(),
        sa.Column("schedule_id", ID, nullable=False),
        sa.Column("run_date", sa.Date(), nullable=False),
        *job_reference("schedule_runs"),
        timestamp("fired_at"),
        sa.ForeignKeyConstraint(["schedule_id"], ["schedules.id"], name=op.f("fk_schedule_runs_schedule_id_schedules"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_schedule_runs")),
        sa.UniqueConstraint("schedule_id", "run_date", name=op.f("uq_schedule_runs_schedule_id_run_date")),
    )
    op.create_table(
        "rejected_messages",
        id_column(),
        sa.Column("topic", sa.String(255), nullable=False),
        sa.Column("partition", sa.Integer(), nullable=False),
        sa.Column("offset", sa.BigInteger(), nullable=False),
        sa.Column("key", sa.Text(), nullable=True),
        sa.Column("payload", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        timestamp("received_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rejected_messages")),
        sa.UniqueConstraint("topic", "partition", "offset", name=op.f("uq_rejected_messages_topic_partition_offset")),
    )
    op.create_table(
        "inbox_objects",
        id_column(),
        sa.Column("bucket", sa.String(255), nullable=False),
        sa.Column("key", sa.String(1024), nullable=False),
        sa.Column("etag", sa.String(255), nullable=False),
        *job_reference("inbox_objects"),
        sa.Column("error", sa.Text(), nullable=True),
        timestamp("seen_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_inbox_objects")),
        sa.UniqueConstraint("bucket", "key", "etag", name=op.f("uq_inbox_objects_bucket_key_etag")),
    )


def downgrade() -> None:
    for table in ("inbox_objects", "rejected_messages", "schedule_runs", "schedules"):
        op.drop_table(table)
