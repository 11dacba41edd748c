"""Anthropic's Message Batches API, a front door served beside OpenAI's Batch API by the same app
(`ingest.openai_api.create_app`): the routes (`routes`) and the translation of requests and results between
Anthropic's shapes and the OpenAI Batch lines tokenmill's jobs read and write (`messages`)."""
