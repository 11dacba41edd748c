"""The OpenAI Batch REST API: its keys, files and batches, and `api` as a job source.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

- `api_keys`: bearer tokens as SHA-256 hashes, each with its tenant; revoked keys keep their row.
- `api_files`: uploaded batch inputs (their object in the bucket) and batches' output and error files.
- `api_batches`: the job each batch is, with its tenant, endpoint, input file, metadata and result files.
- `jobs.source` may be `api`. SQLite cannot alter a CHECK constraint in place, and rebuilding `jobs` would
  cascade-delete its shards, so there the constraint's text is edited in the schema (SQLite's documented way
  for changes that leave the stored rows valid).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
OLD_SOURCES = "source IN ('kafka', 's3', 'cli', 'schedule')"
NEW_SOURCES = "source IN ('kafka', 's3', 'cli', 'schedule', 'api')"


def timestamp(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", ID, autoincrement=True, nullable=False),
        sa.Column("tenant", sa.String(255), nullable=False),
        sa.Column("name", sa.String(255), nullable=True),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("key_prefix", sa.String(16), nullable=False),
        timestamp("created_at"),
        timestamp("revoked_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_index(op.f("ix_api_keys_tenant"), "api_keys", ["tenant"])
    op.create_table(
        "api_files",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("tenant", sa.String(255), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("filename", sa.String(1024), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        timestamp("created_at"),
        timestamp("deleted_at", nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_files")),
    )
    op.create_index(op.f("ix_api_files_tenant"), "api_files", ["tenant"])
    op.create_table(
        "api_batches",
        sa.Column("job_id", sa.String(36), nullable=False),
        sa.Column("tenant", sa.String(255), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(8), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        timestamp("created_at"),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_api_batches_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", name=op.f("pk_api_batches")),
    )
    op.create_index(op.f("ix_api_batches_tenant"), "api_batches", ["tenant"])
    op.create_index(op.f("ix_api_batches_created_at"), "api_batches", ["created_at"])
    _replace_source_check(OLD_SOURCES, NEW_SOURCES)


def downgrade() -> None:
    op.execute(sa.text("DELETE FROM jobs WHERE source = 'api'"))
    _replace_source_check(NEW_SOURCES, OLD_SOURCES)
    for table in ("api_batches", "api_files", "api_keys"):
        op.drop_table(table)


def _replace_source_check(old: str, new: str) -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(op.f("ck_jobs_source"), "jobs", type_="check")
        op.create_check_constraint(op.f("ck_jobs_source"), "jobs", new)
        return
    version = op.get_bind().exec_driver_sql("PRAGMA schema_version").scalar()
    op.execute("PRAGMA writable_schema=ON")
    op.execute(sa.text("UPDATE sqlite_master SET sql = replace(sql, :old, :new) WHERE type = 'table' AND "
                       "name = 'jobs'").bindparams(old=old, new=new))
    op.execute(f"PRAGMA schema_version={version + 1}")
    op.execute("PRAGMA writable_schema=OFF")
