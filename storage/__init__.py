"""Job state in SQL, object stores, Parquet/JSONL readers and writers. No torch here."""
