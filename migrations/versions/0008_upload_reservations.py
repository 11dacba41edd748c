"""Uploads reserve their bytes before they are written.

Revision ID: 0008
Revises: 0007
Create Date: 2027-02-01

- `api_files.ready_at`: when the upload's object was written in full; NULL while it is being written (the row
  holds its bytes against the tenant's quota, and the cleanup removes it if it never becomes ready).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_files") as table:
        table.add_column(sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True))
    op.execute("UPDATE api_files SET ready_at = created_at")


def downgrade() -> None:
    with op.batch_alter_table("api_files") as table:
        table.drop_column("ready_at")
