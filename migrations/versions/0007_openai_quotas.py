"""The OpenAI Batch API, round 2: file expiry, batch output expiry, per-line validation errors.

Revision ID: 0007
Revises: 0006
Create Date: 2027-01-10

- `api_files.expires_at`: when the cleanup deletes the file (uploads' `expires_after`, outputs' from their batch);
  `api_files.lines`: a batch output or error file's lines (its batch's request counts).
- `api_batches.output_expires_after`: seconds after creation that the batch's output and error files live.
- `api_batches.errors`: the lines refused at creation ({line, code, message, param}), OpenAI's `errors.data`.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_files") as table:
        table.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        table.add_column(sa.Column("lines", sa.Integer(), nullable=True))
    op.create_index(op.f("ix_api_files_expires_at"), "api_files", ["expires_at"])
    with op.batch_alter_table("api_batches") as table:
        table.add_column(sa.Column("output_expires_after", sa.Integer(), nullable=True))
        table.add_column(sa.Column("errors", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_batches") as table:
        table.drop_column("errors")
        table.drop_column("output_expires_after")
    op.drop_index(op.f("ix_api_files_expires_at"), "api_files")
    with op.batch_alter_table("api_files") as table:
        table.drop_column("lines")
        table.drop_column("expires_at")
