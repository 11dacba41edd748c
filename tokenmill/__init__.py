"""The tokenmill command line, over engine, storage, ingest and workers."""
