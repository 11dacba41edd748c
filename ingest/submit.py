"""`tokenmill submit`: send a job to the running service through one of its front doors.

The job id is made here and sent as the job's id and idempotency key, so sending again is harmless and
`tokenmill status JOB` finds the job. A local input file is uploaded to the service's bucket first.

- via kafka: the spec goes to the job topic (input in `<bucket>/uploads/<job id>/`);
- via s3: the sidecar `<job id>-NAME.job.json`, then the input `<job id>-NAME.parquet`, go to the inbox.
"""

from __future__ import annotations

import json
import posixpath
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ingest.config import ServiceConfig
from ingest.job_request import validate_request
from storage.job_settings import CELERY
from storage.objectstore import ObjectStore, S3Store, normalize_uri, open_store

SEND_TIMEOUT_S = 30


@dataclass
class Submitted:
    job_id: str
    input_uri: str  # where the input is now (after any upload)
    output_uri: str
    sent_to: str  # the topic, or the inbox object


def submit_job(source: str, via: str, config: ServiceConfig, output_uri: str | None = None,
               **settings: Any) -> Submitted:
    """Send the job of `source` (a path or URI) via 'kafka' or 's3'; `settings` are JobRequest fields."""
    if not config.bucket_uri:
        raise ValueError("no service bucket is known: start the stack (`tokenmill stack up`) or set "
                         "TOKENMILL_BUCKET_URI")
    job_id = str(uuid.uuid4())
    output = output_uri or f"{config.outputs_uri}/{job_id}"
    spec = {**settings, "output_uri": output, "job_id": job_id, "idempotency_key": job_id}
    request = validate_request({**spec, "input_uri": normalize_uri(source)})
    request.to_job(executor=CELERY)  # refuse it here, as the front door would
    for field, uri in request.named_uris().items():
        config.policy.check_outside_api_areas(uri, field)
    if via == "kafka":
        return _via_kafka(source, spec, config)
    if via == "s3":
        return _via_inbox(source, spec, config)
    raise ValueError(f"--via must be kafka or s3, got {via!r}")


def _via_kafka(source: str, spec: dict[str, Any], config: ServiceConfig) -> Submitted:
    if not config.kafka_bootstrap:
        raise ValueError("no Kafka broker is known: start the stack or set TOKENMILL_KAFKA_BOOTSTRAP")
    input_uri = normalize_uri(source)
    if not input_uri.startswith("s3://"):
        uploads = open_store(f"{config.in_bucket('uploads')}/{spec['job_id']}", config.s3)
        input_uri = _copy(source, uploads, posixpath.basename(input_uri))
    send(config.kafka_bootstrap, config.jobs_topic, {**spec, "input_uri": input_uri}, key=spec["job_id"])
    return Submitted(spec["job_id"], input_uri, spec["output_uri"], config.jobs_topic)


def _via_inbox(source: str, spec: dict[str, Any], config: ServiceConfig) -> Submitted:
    inbox = open_store(config.inbox_uri, config.s3)
    name = f"{spec['job_id']}-{posixpath.basename(normalize_uri(source))}"
    stem = posixpath.splitext(name)[0]
    inbox.put_bytes(f"{stem}.job.json", json.dumps(spec, indent=2).encode())  # the sidecar first
    input_uri = _copy(source, inbox, name)
    return Submitted(spec["job_id"], input_uri, spec["output_uri"], input_uri)


def _copy(source: str, target: ObjectStore, key: str) -> str:
    """Put the file at source (a path or URI) into target as key; returns its new URI."""
    uri = normalize_uri(source)
    if uri.startswith("file://"):
        path = Path(uri[len("file://"):])
        if not path.is_file():
            raise FileNotFoundError(f"no input file {path}")
        target.put_file(key, path)
    elif isinstance(target, S3Store):  # server-side copy, multipart for big objects
        bucket, _, source_key = uri[len("s3://"):].partition("/")
        target.client.copy({"Bucket": bucket, "Key": source_key}, target.bucket, target.key(key))
    else:
        raise ValueError(f"cannot copy {uri} to {target.uri}: the service bucket must be an s3:// URI")
    return target.uri_of(key)


def send(bootstrap: str, topic: str, document: dict[str, Any] | bytes, key: str | None = None):
    """Produce one message and wait until the broker has it; its RecordMetadata (partition, offset)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", retries=5, reconnect_backoff_max_ms=2000)
    try:
        value = document if isinstance(document, bytes) else json.dumps(document).encode()
        return producer.send(topic, value=value, key=key.encode() if key else None).get(timeout=SEND_TIMEOUT_S)
    finally:
        producer.close(timeout=5)
