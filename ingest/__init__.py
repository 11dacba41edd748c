"""Front doors: Kafka consumer, S3/local drop watcher, CLI submit; validation of job specs and input files."""
