"""The OpenAI Batch REST API, a front door beside Kafka and the S3 inbox: `create_app(ApiService(...))` is an
ASGI app that `tokenmill api` serves with uvicorn, Anthropic's Message Batches API (`ingest.anthropic_api`) beside
it."""

from ingest.openai_api.app import ApiService, create_app

__all__ = ["ApiService", "create_app"]
