"""Leases on the database clock for job steps, and the broker marker.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

- `jobs.lease_expires_at`: the lease of the process holding the job's plan or finalize step (or `tokenmill run`),
  on the database's clock; while no one holds it, when the sweep last resent the step.
- `service_markers`: small named values the service keeps, e.g. the broker marker: a value also written into
  the broker, so a broker that lost its state (a Redis FLUSHALL or restart) is noticed at the next sweep.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "service_markers",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("value", sa.String(255), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_service_markers")),
    )


def downgrade() -> None:
    op.drop_table("service_markers")
    op.drop_column("jobs", "lease_expires_at")
