"""Claims: one live job per output prefix, and fencing tokens for shard and job step claims.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01

- `jobs.output_claim`: the normalized output prefix while the job is live, NULL once it is terminal; unique, so
  a second live job on the same prefix is refused.
- `jobs.claim_token`, `shards.claim_token`: an epoch bumped by every claim; a worker's writes are conditional on
  the token it claimed with, so a worker whose claim was taken over writes nothing.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("output_claim", sa.String(2048), nullable=True))
    op.create_index(op.f("ix_jobs_output_claim"), "jobs", ["output_claim"], unique=True)
    for table in ("jobs", "shards"):
        op.add_column(table, sa.Column("claim_token", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_index(op.f("ix_jobs_output_claim"), "jobs")
    for table in ("jobs", "shards"):
        op.drop_column(table, "claim_token")
    op.drop_column("jobs", "output_claim")
