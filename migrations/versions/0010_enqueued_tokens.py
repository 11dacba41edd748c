"""A tenant's enqueued prompt tokens per model, as OpenAI's batch queue limit counts them.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07

- `api_batches.enqueued_tokens`: the prompt tokens a batch's input was estimated at when it was made (UTF-8 bytes
  of its prompts / 4); while its job has not ended they count against `--max-enqueued-tokens`. NULL (batches made
  before) counts as 0.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_batches") as table:
        table.add_column(sa.Column("enqueued_tokens", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_batches") as table:
        table.drop_column("enqueued_tokens")
