"""`tokenmill bench kv-sharing`: one job whose rows share long prefixes (a few distinct system prompts of 512+
tokens, many questions each, in shuffled order) run by two real Celery workers (`tokenmill worker`, each its own
process and threads), once without and once with `--kv-sharing`, on a SQLite database and a local folder in a
temporary directory, with the local Redis as broker and KV store. Each run starts its two workers afresh, warms them
with a small job of other prompts, then times the job from submit to completed.

The workers load their engine through `counting_engine` (`tokenmill worker --engine-factory`): the real engine,
which also writes its prefill tokens computed and its KV connector's counts to a file after every step, so the
benchmark can tell tokens loaded from the store from tokens found in a worker's own prefix cache."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from storage.formats import CHAT
from tokenmill.bench.workload import questions, system_prompt

STATS_ENV = "TOKENMILL_KV_BENCH_STATS"
WORKERS = 2
START_TIMEOUT_S = 300
TERMINAL = ("completed", "failed", "cancelled", "expired")


# ---- inside each worker ----------------------------------------------------------------------------

def counting_engine(settings: dict[str, Any]):
    """The worker's real engine (`workers.worker_engine.load_engine`), writing its counts to $TOKENMILL_KV_BENCH_STATS
    once loaded and after every step that changed them."""
    from workers.worker_engine import load_engine

    engine = load_engine(settings)
    path, base = Path(os.environ[STATS_ENV]), engine.stats.computed_prefill_tokens
    last: dict[str, int] = {}

    def write(_outputs=None) -> None:
        connector = engine.kv_connector
        counts = {"computed_prefill_tokens": engine.stats.computed_prefill_tokens - base,
                  "block_size": engine.config.block_size,
                  **(asdict(connector.stats) if connector is not None else {})}
        if counts != last:
            last.clear()
            last.update(counts)
            partial = path.with_name(path.name + ".part")
            partial.write_text(json.dumps(counts))
            os.replace(partial, path)

    write()
    engine.step_observers.append(write)
    return engine


# ---- the job -----------------------------------------------------------------------------------------

@dataclass
class Workload:
    num_prefixes: int
    questions_per_prefix: int
    prefix_tokens: int
    max_tokens: int
    seed: int = 0

    @property
    def num_rows(self) -> int:
        return self.num_prefixes * self.questions_per_prefix


def write_rows(path: Path, tokenizer, workload: Workload, title: str = "Guide") -> Path:
    """OpenAI Batch JSONL chat rows: system prompt p (at least `prefix_tokens` tokens, distinct from its first
    line) and question q, for every p and q, shuffled; `max_tokens` each (the job runs them greedy, EOS ignored)."""
    systems = [system_prompt(workload.prefix_tokens, tokenizer, f"{title} {p + 1} of {workload.num_prefixes}")
               for p in range(workload.num_prefixes)]
    pool = questions()
    rows = []
    for p, system in enumerate(systems):
        for q in range(workload.questions_per_prefix):
            question = pool[q % len(pool)] + ("" if q < len(pool) else f" (take {q // len(pool) + 1})")
            body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
                    "max_tokens": workload.max_tokens}
            rows.append({"custom_id": f"p{p}-q{q}", "method": "POST", "url": CHAT, "body": body})
    random.Random(workload.seed).shuffle(rows)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@dataclass
class SharingRun:
    label: str
    seconds: float  # submit to completed
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens not computed: loaded from the store or found in a worker's prefix cache
    computed_prefill_tokens: int  # prompt (and recomputed) tokens the workers ran through the model
    blocks_loaded: int
    blocks_saved: int
    store_errors: int
    block_size: int
    workers_used: int  # workers that ran at least one of the job's shards
    stored_mib: float  # the blocks the job added to Redis
    outputs: dict[str, str] = field(repr=False)  # custom_id -> text

    @property
    def tokens_loaded(self) -> int:
        return self.blocks_loaded * self.block_size

    @property
    def tokens_per_second(self) -> float:
        return (self.prompt_tokens + self.completion_tokens) / self.seconds

    @property
    def completion_tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds


@dataclass
class WorkerSettings:
    model: str = "smollm2-135m"
    threads: int = 1
    dtype: str = "auto"
    kv_cache_memory: float = 0.5
    shards_in_flight: int = 1
    redis_url: str = "redis://127.0.0.1:6379/0"

    @property
    def kv_redis_url(self) -> str:
        """Where the workers keep their shared blocks: the broker's Redis, database KV_DB (workers.kv_sharing)."""
        from ingest.config import ServiceConfig
        from workers.kv_sharing import default_kv_redis_url

        service = ServiceConfig.from_env()
        return default_kv_redis_url(dataclasses.replace(service, broker_url=self.redis_url,
                                                        result_backend=self.redis_url))


class Workers:
    """Two `tokenmill worker` processes (each its own supervisor, engine node and control node) on queues of their
    own (TOKENMILL_QUEUE_PREFIX), which also keys the shared blocks apart from any other run's."""

    def __init__(self, workdir: Path, label: str, settings: WorkerSettings, sharing: bool) -> None:
        self.workdir, self.settings = workdir, settings
        self.prefix = f"kvbench-{uuid.uuid4().hex[:8]}-{label}."
        self.database_url = f"sqlite:///{workdir / f'{label}.db'}"
        self.stats_files = [workdir / f"{label}-worker{i}.json" for i in range(WORKERS)]
        self.processes: list[subprocess.Popen] = []
        env = {**os.environ, "TOKENMILL_DATABASE_URL": self.database_url, "TOKENMILL_BROKER_URL": settings.redis_url,
               "TOKENMILL_RESULT_BACKEND": settings.redis_url, "TOKENMILL_QUEUE_PREFIX": self.prefix,
               "TOKENMILL_DATA": str(workdir / "data"),
               "TOKENMILL_KV_REDIS_URL": settings.kv_redis_url, "TOKENMILL_KV_SECRET": secrets.token_urlsafe(32)}
        for name in ("TOKENMILL_ENGINE_FACTORY", "TOKENMILL_KAFKA_BOOTSTRAP", "TOKENMILL_METRICS_PORT",
                     "TOKENMILL_WORKER_CHILD", "TOKENMILL_KV_TTL_S", "TOKENMILL_KV_DISAGGREGATION"):
            env.pop(name, None)
        for index, stats in enumerate(self.stats_files):
            command = [sys.executable, "-m", "tokenmill", "worker", "--name", f"{self.prefix}w{index}",
                       "--model", settings.model, "--threads", str(settings.threads), "--dtype", settings.dtype,
                       "--kv-cache-memory", str(settings.kv_cache_memory), "--shards-in-flight",
                       str(settings.shards_in_flight), "--control-threads", "1", "--no-enable-lora",
                       "--state-dir", str(workdir / "no-stack"), "--engine-factory", f"{__name__}:counting_engine",
                       *(["--kv-sharing"] if sharing else [])]
            with open(workdir / f"{label}-worker{index}.log", "wb") as log:
                self.processes.append(subprocess.Popen(command, env={**env, STATS_ENV: str(stats)}, stdout=log,
                                                       stderr=subprocess.STDOUT, start_new_session=True))

    def wait_loaded(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not all(path.exists() for path in self.stats_files):
            for index, process in enumerate(self.processes):
                if process.poll() is not None:
                    raise RuntimeError(f"worker {index} ended ({process.returncode}) before loading its engine:\n"
                                       f"{self.log_tail(index)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the workers did not load their engines within {timeout:.0f} s")
            time.sleep(0.2)

    def log_tail(self, index: int) -> str:
        label = self.stats_files[index].stem
        return (self.workdir / f"{label}.log").read_text(errors="replace")[-3000:]

    def counts(self) -> list[dict[str, int]]:
        return [json.loads(path.read_text()) for path in self.stats_files]

    def stop(self) -> None:
        for process in self.processes:  # each supervisor and its two nodes: the group it leads
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def forget(self) -> None:
        """Remove this run's keys from Redis: its queues and their bindings, and its shared blocks."""
        import redis

        for url, patterns in ((self.settings.redis_url, (f"{self.prefix}*", f"_kombu.binding.{self.prefix}*")),
                              (self.settings.kv_redis_url, (f"{self.prefix}*",))):
            client = redis.Redis.from_url(url)
            try:
                for pattern in patterns:
                    keys = list(client.scan_iter(match=pattern, count=1000))
                    if keys:
                        client.unlink(*keys)
            finally:
                client.close()

    def stored_mib(self) -> float:
        import redis

        from workers.kv_sharing import KEY_PREFIX

        client = redis.Redis.from_url(self.settings.kv_redis_url)
        try:
            keys = list(client.scan_iter(match=f"{self.prefix}{KEY_PREFIX}*", count=1000))
            return sum(client.strlen(key) for key in keys) / 2**20
        finally:
            client.close()


def run_job(workers: Workers, rows: Path, output: Path, shard_size: int,
            timeout: float) -> tuple[float, list[dict], int]:
    """Submit the job of `rows` to the workers' queues and wait until it completed: (seconds, its result rows, how
    many workers ran its shards)."""
    from celery import Celery

    from ingest.intake import submit
    from ingest.job_request import JobRequest
    from storage import db
    from storage import repository as repo
    from storage.formats import read_part
    from storage.job_settings import CELERY
    from storage.objectstore import open_store

    sessions = db.session_factory(db.make_engine(workers.database_url))
    app = Celery(broker=workers.settings.redis_url)
    try:
        request = JobRequest(input_uri=str(rows), output_uri=str(output), model=workers.settings.model,
                             shard_size=shard_size, sampling={"temperature": 0.0, "ignore_eos": True})
        started = time.perf_counter()
        job_id = submit(sessions, request.to_job(executor=CELERY)).job.id
        app.send_task("tokenmill.plan_job", args=[job_id], queue=f"{workers.prefix}control")
        deadline = time.monotonic() + timeout
        while True:
            with sessions() as session:
                job = repo.get_job(session, job_id)
                status, error = job.status, job.error
                workers_used = len({shard.worker for shard in repo.shards(session, job_id)})
            if status in TERMINAL:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job did not end within {timeout:.0f} s (it is {status})")
            time.sleep(0.05)
        seconds = time.perf_counter() - started
    finally:
        app.close()
        sessions.kw["bind"].dispose()
    if status != "completed":
        raise RuntimeError(f"the job ended {status}: {error}")
    store = open_store(str(output))
    records = [r for key in store.list() if key.startswith("part-") for r in read_part(store, key).to_pylist()]
    return seconds, records, workers_used


def measure(label: str, sharing: bool, workdir: Path, rows: Path, warm_rows: Path, settings: WorkerSettings,
            shard_size: int, timeout: float) -> SharingRun:
    """Two fresh workers (`--kv-sharing` or not): an untimed warm-up job of one-row shards, then the timed job."""
    from storage import migrate

    workdir.mkdir(parents=True)
    name = label.split()[0]  # in file names and URIs
    workers = Workers(workdir, name, settings, sharing)
    try:
        migrate.upgrade(workers.database_url)
        workers.wait_loaded()
        run_job(workers, warm_rows, workdir / f"{name}-warm-out", 1, timeout)
        before, stored_before = workers.counts(), workers.stored_mib()
        seconds, records, workers_used = run_job(workers, rows, workdir / f"{name}-out", shard_size, timeout)
        time.sleep(0.5)  # margin: the last step's counts are written as the step returns
        after, stored = workers.counts(), workers.stored_mib() - stored_before
    finally:
        workers.stop()
        workers.forget()

    def delta(count: str) -> int:
        return sum(a.get(count, 0) - b.get(count, 0) for a, b in zip(after, before, strict=True))

    return SharingRun(label, seconds, sum(r["prompt_tokens"] for r in records),
                      sum(r["completion_tokens"] for r in records), sum(r["cached_tokens"] for r in records),
                      delta("computed_prefill_tokens"), delta("blocks_loaded"), delta("blocks_saved"),
                      delta("store_errors"), after[0]["block_size"], workers_used, stored,
                      {r["custom_id"]: r["text"] for r in records})


def compare(tokenizer, workload: Workload, settings: WorkerSettings, shard_size: int, repeats: int = 1,
            timeout: float = 1800) -> list[tuple[SharingRun, SharingRun]]:
    """(without, with) KV sharing over the same rows, `repeats` times, each run with two fresh workers."""
    pairs = []
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-kv-sharing-") as directory:
        workdir = Path(directory)
        rows = write_rows(workdir / "rows.jsonl", tokenizer, workload)
        warm = Workload(2, 2, 32, 2, workload.seed + 1)
        warm_rows = write_rows(workdir / "warm.jsonl", tokenizer, warm, title="Warm-up notes")
        for repeat in range(1, repeats + 1):
            suffix = f" #{repeat}" if repeats > 1 else ""
            pairs.append(tuple(measure(f"{label}{suffix}", sharing, workdir / f"{label}-{repeat}", rows, warm_rows,
                                       settings, shard_size, timeout)
                               for label, sharing in (("without", False), ("with", True))))
    return pairs
