"""Multi-LoRA on the stack (docs/lora.md): a job sent via Kafka whose rows name three adapters (local directories
that `tokenmill submit --lora-modules` uploads to the bucket) and the base model runs on the base model's workers,
which serve LoRA whatever adapters a job brings; each row gets its adapter's greedy text, every custom_id once.
`tokenmill model list` shows what each worker serves: LoRA on, the adapters it fetched for the job, and a worker's
own `--lora-modules`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.fixtures_services import REPO
from tests.jobs.jobhelpers import assert_each_id_once
from tests.service.conftest import stop_process_group, submit_file, wait_for_job, wait_until
from tokenmill.bench.lora_adapters import make_adapters

pytestmark = pytest.mark.real_model
BASE = "smollm2-135m"
ADAPTERS = ("sql", "poet", "pirate")
QUESTIONS = ["Name a color.", "What is a haiku?", "Where do penguins live?"]
MAX_TOKENS = 8


def write_rows(path, rows: list[tuple[str, str, str]]):
    """An OpenAI chat JSONL of (custom_id, question, model or adapter name) rows."""
    path.write_text("".join(json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                                        "body": {"model": name, "messages": [{"role": "user", "content": question}]}})
                            + "\n" for custom_id, question, name in rows))
    return path


def engine_texts(dtype: str, rows: list[tuple[str, str, str]], dirs: dict) -> list[str]:
    """Each row's greedy text from the offline engine with its adapter (names not in `dirs`: the base model)."""
    from engine import LLM, LoRARequest, SamplingParams

    llm = LLM(dtype=dtype, batch_invariant="auto", enable_lora=True, max_loras=4, num_threads=1,
              kv_cache_memory=256 << 20)
    requests = {name: LoRARequest(name, i + 1, str(dirs[name])) for i, name in enumerate(ADAPTERS)}
    outputs = llm.generate([llm.apply_chat_template([{"role": "user", "content": q}]) for _, q, _ in rows],
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                           lora_request=[requests.get(name) for *_, name in rows])
    return [o.outputs[0].text for o in outputs]


def test_a_kafka_job_gives_each_row_its_adapters_greedy_text(stack, sessions, tmp_path) -> None:
    dirs = dict(zip(ADAPTERS, make_adapters(tmp_path / "adapters", len(ADAPTERS), rank=8, seed=31), strict=True))
    rows = [(f"{name}-{q}", question, name) for q, question in enumerate(QUESTIONS) for name in (*ADAPTERS, BASE)]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    job_id = submit_file(stack, path, "--max-tokens", str(MAX_TOKENS), "--shard-size", "4", "--lora-modules",
                         *(f"{name}={directory}" for name, directory in dirs.items()))
    job = wait_for_job(sessions, job_id, timeout=300)
    assert job["status"] == "completed", job["error"]
    assert job["model"] == BASE  # the base model's queue, whatever adapters the rows name
    uploaded = job["settings"]["lora_modules"]
    assert sorted(uploaded) == sorted(ADAPTERS)
    assert all(uri.startswith(f"{stack.bucket}/adapters/{name}-") for name, uri in uploaded.items())
    results, errors, _ = assert_each_id_once(stack.store(job["output_uri"]), [custom_id for custom_id, *_ in rows])
    assert errors == []

    # the workers' engine: the stack's dtype and batch invariance (auto: bfloat16 on AMX CPUs, else float32), LoRA on
    got = {r["custom_id"]: r["text"] for r in results}
    assert [got[custom_id] for custom_id, *_ in rows] == engine_texts("auto", rows, dirs)

    listing = stack.cli("model", "list").stdout
    for worker in ("worker1", "worker2"):
        line = next(line for line in listing.splitlines() if f"{worker}@" in line)
        assert BASE in line and "on, 4 slots" in line
    assert all(uri in listing for uri in uploaded.values())  # fetched into the workers' cache


def test_a_float32_worker_gives_each_row_its_adapters_exact_greedy_text(stack, sessions, tmp_path) -> None:
    """The done-when in float32: a worker of its own (`--dtype float32`) serving the model under a name of its own
    (a local copy in the model cache, so a queue of its own) runs a Kafka job of three adapters and the base model;
    each row's text is the engine's float32 greedy text with its adapter, which tests/engine/test_lora.py holds
    equal to Hugging Face + PEFT merged."""
    from engine.model_loader import models_dir, resolve_model

    model_dir = "smollm2-135m-float32"  # a job's model is a name: a local copy in the model cache
    copy = models_dir() / model_dir
    copy.unlink(missing_ok=True)
    copy.symlink_to(resolve_model(BASE), target_is_directory=True)
    dirs = dict(zip(ADAPTERS, make_adapters(tmp_path / "adapters", len(ADAPTERS), rank=8, seed=32), strict=True))
    rows = [(f"{q}-{name}", question, name) for q, question in enumerate(QUESTIONS) for name in (*ADAPTERS, model_dir)]
    path = write_rows(tmp_path / "rows.jsonl", rows)
    env = {**stack.env, "PYTHONPATH": str(REPO)}
    worker = subprocess.Popen([sys.executable, "-m", "tokenmill", "worker", "--name", "lora-float32", "--model",
                               model_dir, "--dtype", "float32", "--control-threads", "0", "--threads", "1",
                               "--state-dir", str(stack.dir)], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        job_id = submit_file(stack, path, "--model", model_dir, "--max-tokens", str(MAX_TOKENS), "--shard-size", "4",
                             "--lora-modules",
                             *(f"{name}={directory}" for name, directory in dirs.items()))
        job = wait_for_job(sessions, job_id, timeout=300)
    finally:
        stop_process_group(worker, timeout=30)
        copy.unlink()
    assert job["status"] == "completed", job["error"]
    results, errors, _ = assert_each_id_once(stack.store(job["output_uri"]), [custom_id for custom_id, *_ in rows])
    assert errors == []
    got = {r["custom_id"]: r["text"] for r in results}
    expected = engine_texts("float32", rows, dirs)
    assert [got[custom_id] for custom_id, *_ in rows] == expected
    assert len({text for text, (*_, name) in zip(expected, rows, strict=True) if name != model_dir}) > len(QUESTIONS)


def test_model_list_shows_a_workers_own_adapters(stack) -> None:
    env = {**stack.env, "PYTHONPATH": str(REPO)}
    process = subprocess.Popen([sys.executable, "-m", "tokenmill", "worker", "--name", "lora-lister", "--queues",
                                "lora-lister-only", "--control-threads", "0", "--threads", "1", "--lora-modules",
                                f"legal={stack.bucket}/adapters/legal", "--state-dir", str(stack.dir)], cwd=REPO,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:  # its own queue only: it takes none of the stack's shards, nor loads a model
        line = wait_until(lambda: next((line for line in stack.cli("model", "list").stdout.splitlines()
                                        if "lora-lister@" in line), None), "the worker to answer", timeout=90,
                          every=2)
        assert "legal" in line and f"{stack.bucket}/adapters/legal" in line
    finally:
        stop_process_group(process, timeout=30)
