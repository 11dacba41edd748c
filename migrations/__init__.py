"""Alembic environment and revisions for tokenmill's database. Run them with `tokenmill db upgrade`."""
