"""`tokenmill bench jobs --against-engine`: one-token chat rows through `tokenmill run`'s path (the in-process job
runner, SQLite and a local folder in a temporary directory, the engine built beforehand, so its load is not
timed) against the engine alone (`LLM.chat` on the same conversations and sampling settings). `--memory`: the
job alone at two sizes, each in a fresh process, for peak RSS and finalize time."""

from __future__ import annotations

import contextlib
import functools
import json
import resource
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from storage.formats import CHAT

# `tokenmill run`'s sampling defaults (its --max-tokens 64, top_p 1, top_k 0, no seed, no stop); rows set
# max_tokens 1 and ignore_eos keeps every row at exactly one token
RUN_DEFAULTS = {"max_tokens": 64, "top_p": 1.0, "top_k": 0, "seed": None, "stop": [], "ignore_eos": True}


def job_defaults(sampling: str) -> dict[str, Any]:
    """The job's sampling defaults: greedy sets temperature 0; default and seeded leave OpenAI's 1.0."""
    return {**RUN_DEFAULTS, **({"temperature": 0.0} if sampling == "greedy" else {})}


@functools.cache
def _questions() -> tuple[str, ...]:
    from tokenmill.bench.workload import questions

    return tuple(questions())


def row_text(index: int) -> str:
    """Row `index`'s question, distinct for every row (as `workload.mixed_chat_questions`)."""
    pool = _questions()
    return pool[index % len(pool)] + ("" if index < len(pool) else f" (take {index // len(pool) + 1})")


def write_one_token_rows(path: Path, num_rows: int, sampling: str) -> Path:
    """OpenAI Batch JSONL: `num_rows` distinct chat rows of max_tokens 1, streamed to disk (a million rows never
    sit in memory). "seeded": each row at temperature 1 with its own seed (its index)."""
    with open(path, "w") as f:
        for index in range(num_rows):
            body: dict[str, Any] = {"messages": [{"role": "user", "content": row_text(index)}], "max_tokens": 1}
            if sampling == "seeded":
                body.update(temperature=1.0, seed=index)
            f.write(json.dumps({"custom_id": f"row-{index:07d}", "method": "POST", "url": CHAT, "body": body}) + "\n")
    return path


def engine_params(num_rows: int, sampling: str) -> list:
    """The rows' SamplingParams as the job merges them (job defaults under each row's own)."""
    from engine import SamplingParams

    common = {key: value for key, value in RUN_DEFAULTS.items() if key != "max_tokens"}
    if sampling == "seeded":
        return [SamplingParams(**(common | {"seed": i}), max_tokens=1, temperature=1.0) for i in range(num_rows)]
    return [SamplingParams(**common, max_tokens=1, temperature=0.0 if sampling == "greedy" else 1.0)] * num_rows


@dataclass
class Timed:
    label: str
    rows: int
    seconds: float
    peak_rss_mb: float  # of the process so far
    finalize_s: float | None = None  # the job's finalize step
    rss_before_mb: float | None = None  # the process's RSS when the job was submitted
    cpu_seconds: float | None = None  # the process's CPU time (all threads) while it ran
    setup_s: float | None = None  # the job's submit, validation and planning: until it starts generating

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_engine_alone(engine, num_rows: int, sampling: str) -> Timed:
    """`LLM.chat` over the rows' conversations (templating included, as the job does it), timed."""
    from engine import LLM

    llm = LLM.__new__(LLM)  # the offline API over the engine already built: its load is not timed
    llm.engine = engine
    conversations = [[{"role": "user", "content": row_text(i)}] for i in range(num_rows)]
    params = engine_params(num_rows, sampling)
    engine.kv_manager.pool.reset_prefix_cache()
    cpu, started = cpu_seconds(), time.perf_counter()
    outputs = llm.chat(conversations, params)
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    done = sum(1 for output in outputs if output.outputs and len(output.outputs[0].token_ids) == 1)
    if done != num_rows:
        raise RuntimeError(f"the engine finished {done} of {num_rows} rows with one token")
    return Timed("engine alone (LLM.chat)", num_rows, seconds, peak_rss_mb(), cpu_seconds=cpu)


class PhaseClock:
    """A job's progress (`workers.progress.Progress`) that notes when each phase began and passes all on to
    `inner` (`tokenmill run`'s bar), if any."""

    def __init__(self, inner=None) -> None:
        self.inner = inner
        self.phases: dict[str, float] = {}

    def phase(self, description: str) -> None:
        self.phases[description] = time.perf_counter()
        if self.inner is not None:
            self.inner.phase(description)

    def start(self, total_rows: int, done_rows: int) -> None:
        if self.inner is not None:
            self.inner.start(total_rows, done_rows)

    def advance(self, rows: int, tokens: int) -> None:
        if self.inner is not None:
            self.inner.advance(rows, tokens)

    def flush(self) -> None:
        if flush := getattr(self.inner, "flush", None):
            flush()


def run_job_timed(engine, rows: Path, workdir: Path, shard_size: int | None, sampling: str, label: str,
                  progress_bar=contextlib.nullcontext) -> Timed:
    """One job over `rows` through the in-process runner on `engine`, timed from submit to completed.
    `progress_bar()`: a context manager giving the job's `workers.progress.Progress` (`tokenmill run`'s bar, which
    the CLI passes in; none by default)."""
    from ingest.intake import submit
    from ingest.job_request import JobRequest
    from storage import db, migrate
    from storage.job_settings import DEFAULT_SHARD_SIZE, LOCAL
    from workers.inprocess import run_job

    url = f"sqlite:///{workdir / f'{label}.db'}"
    migrate.upgrade(url)
    sessions = db.session_factory(db.make_engine(url))
    request = JobRequest(input_uri=str(rows), output_uri=str(workdir / f"out-{label}"),
                         shard_size=shard_size or DEFAULT_SHARD_SIZE, sampling=job_defaults(sampling))
    engine.kv_manager.pool.reset_prefix_cache()
    before, cpu = rss_mb(), cpu_seconds()
    started = time.perf_counter()
    job = submit(sessions, request.to_job(executor=LOCAL)).job
    with progress_bar() as bar:
        clock = PhaseClock(bar)
        job = run_job(sessions, job.id, lambda settings: engine, clock)
    ended, cpu = time.perf_counter(), cpu_seconds() - cpu
    sessions.kw["bind"].dispose()
    if job.status != "completed" or job.requests_completed != job.requests_total:
        raise RuntimeError(f"the {label} job ended {job.status} with {job.requests_completed} of "
                           f"{job.requests_total} rows: {job.error}")
    finalize_started = clock.phases.get("writing errors and manifest", ended)
    return Timed(f"tokenmill run ({label})", job.requests_completed, ended - started, peak_rss_mb(),
                 ended - finalize_started, before, cpu, clock.phases.get("generating", started) - started)


def against_engine(engine, num_rows: int, sampling: str, shard_size: int | None, repeats: int = 1,
                   on_pair=None, progress_bar=contextlib.nullcontext) -> list[tuple[Timed, Timed]]:
    """(engine alone, job) pairs over the same rows, after an untimed warm-up of each (`on_pair` is called with
    each as it comes); with `repeats` > 1 the two alternate, so both see the same load on a shared machine.
    `progress_bar`: as `run_job_timed`'s."""
    with tempfile.TemporaryDirectory(prefix="tokenmill-bench-jobs-") as directory:
        workdir = Path(directory)
        warm = write_one_token_rows(workdir / "warm.jsonl", 8, sampling)
        run_engine_alone(engine, 8, sampling)
        run_job_timed(engine, warm, workdir, 4, sampling, "warm-up", progress_bar)
        rows = write_one_token_rows(workdir / "rows.jsonl", num_rows, sampling)
        pairs = []
        for repeat in range(repeats):
            alone = run_engine_alone(engine, num_rows, sampling)
            job = run_job_timed(engine, rows, workdir, shard_size, sampling, f"run-{repeat}", progress_bar)
            pairs.append((alone, job))
            if on_pair is not None:
                on_pair(alone, job)
    return pairs


def job_in_fresh_process(engine_kwargs: dict[str, Any], rows: str, workdir: str, shard_size: int | None,
                         sampling: str, label: str, progress_bar=contextlib.nullcontext) -> dict[str, Any]:
    """(In a spawned process) load the engine, run one job, and give its timing and this process's peak RSS."""
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs))
    loaded_rss = rss_mb()
    timed = run_job_timed(engine, Path(rows), Path(workdir), shard_size, sampling, label, progress_bar)
    return asdict(timed) | {"loaded_rss_mb": loaded_rss}


def memory(engine_kwargs: dict[str, Any], sizes: list[int], sampling: str, shard_size: int | None,
           workdir: Path, progress_bar=contextlib.nullcontext) -> list[dict[str, Any]]:
    """The job alone at each size (rows), each in a fresh process: its timing, finalize and peak RSS.
    `progress_bar`: as `run_job_timed`'s, a module-level function (it is pickled by name)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    results = []
    for size in sizes:
        rows = write_one_token_rows(workdir / f"rows-{size}.jsonl", size, sampling)
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results.append(pool.submit(job_in_fresh_process, engine_kwargs, str(rows), str(workdir), shard_size,
                                       sampling, f"{size}-rows", progress_bar).result())
        rows.unlink()
    return results
