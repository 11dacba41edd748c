"""Celery app, tasks, beat schedules and the worker-side engine lifecycle."""
