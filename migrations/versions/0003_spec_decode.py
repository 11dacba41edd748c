"""Speculative-decoding counters per shard and per job, so the manifest can report acceptance.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29

- `shards.spec_draft_tokens`, `shards.spec_accepted_tokens`: draft tokens verified and accepted while the
  shard ran (0 without speculation).
- `jobs.spec_draft_tokens`, `jobs.spec_accepted_tokens`: their sums over the job's completed shards.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

COLUMNS = ("spec_draft_tokens", "spec_accepted_tokens")


def upgrade() -> None:
    for table in ("jobs", "shards"):
        for name in COLUMNS:
            op.add_column(table, sa.Column(name, sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    # Plain ALTER TABLE ... DROP COLUMN (SQLite >= 3.35): no table copy, so the job_status view stays valid.
    for table in ("jobs", "shards"):
        for name in COLUMNS:
            op.drop_column(table, name)
