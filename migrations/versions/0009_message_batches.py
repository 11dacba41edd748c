"""Anthropic's Message Batches API beside OpenAI's Batch API.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07

- `api_batches.error_codes`: the error lines of an ended batch's results by code (`batch_cancelled`,
  `batch_expired`, ...), counted once when its result files are written: a message batch's `request_counts`
  (errored, canceled, expired). A message batch is an `api_batches` row whose endpoint is `/v1/messages`.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_batches") as table:
        table.add_column(sa.Column("error_codes", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_batches") as table:
        table.drop_column("error_codes")
