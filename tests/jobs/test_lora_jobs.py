"""Multi-LoRA jobs (docs/lora.md): `tokenmill run --lora-modules`, rows picking their adapter by `model` (OpenAI
JSONL bodies, a Parquet `model` column), each row's greedy float32 text equal to the engine's own with that adapter
(`LLM(enable_lora=True)`, which tests/engine/test_lora.py holds to Hugging Face + PEFT), every custom_id once; an
unknown model fails its row with model_not_found, an adapter that cannot be served (a malformed config too) with
invalid_adapter. Adapters in S3 are fetched once into the cache, again when they change; the cache evicts the least
recently used past its limit, never one in use. And the options and spec checks around them."""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import time
from pathlib import Path

import pytest

from ingest.job_request import JobRequestError, validate_request
from storage.job_settings import CELERY
from storage.objectstore import S3Options, open_store
from tests.jobs.jobhelpers import assert_each_id_once, write_parquet
from tokenmill.bench.lora_adapters import make_adapters
from tokenmill.cli import build_parser, main
from tokenmill.options import engine_kwargs, lora_modules
from workers.adapters import AdapterSource, cached_adapters, fetch, resolve_adapters

BASE = "smollm2-135m"
ADAPTERS = ("sql", "poet", "pirate")
QUESTIONS = ["Name a color.", "What is a haiku?", "Where do penguins live?"]
MAX_TOKENS = 8
FAST = ["--dtype", "float32", "--temperature", "0", "--max-tokens", str(MAX_TOKENS), "--threads", "2",
        "--kv-cache-memory", "0.25", "--max-num-seqs", "32"]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    dirs = make_adapters(root / "rank8", len(ADAPTERS), rank=8, seed=7)
    [too_big] = make_adapters(root / "rank32", 1, rank=32, seed=8)  # over the default --max-lora-rank 16
    return {**dict(zip(ADAPTERS, dirs, strict=True)), "too-big": too_big}


@pytest.fixture(scope="module")
def reference(model_dir):
    """The engine with LoRA, float32 and batch-invariant where it costs nothing, as the jobs run it: what each row's
    text must be."""
    from engine import LLM

    return LLM(dtype="float32", enable_lora=True, max_loras=len(ADAPTERS), num_threads=2,
               kv_cache_memory=256 << 20, max_num_seqs=32, batch_invariant="auto")


def expected(llm, adapter_dirs: dict[str, Path], rows: list[tuple[str | list, str | None]]) -> list[str]:
    """The greedy texts of (chat messages or prompt, adapter name or None) in one batch."""
    from engine import LoRARequest, SamplingParams

    ids = {name: i + 1 for i, name in enumerate(adapter_dirs)}
    loras = [None if name is None else LoRARequest(name, ids[name], str(adapter_dirs[name])) for _, name in rows]
    prompts = [llm.apply_chat_template(p) if isinstance(p, list) else p for p, _ in rows]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0), lora_request=loras)
    return [output.outputs[0].text for output in outputs]


def chat_line(custom_id: str, question: str, model: str | None) -> dict:
    body = {"messages": [{"role": "user", "content": question}], **({"model": model} if model else {})}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def modules(adapter_dirs: dict[str, Path], *names: str) -> list[str]:
    return ["--lora-modules", *(f"{name}={adapter_dirs[name]}" for name in names)]


def texts(results: list[dict]) -> dict[str, str]:
    return {r["custom_id"]: r["text"] for r in results}


# ---- tokenmill run ------------------------------------------------------------------------------------

def test_run_gives_each_openai_row_its_adapter_and_fails_unknown_models_and_bad_adapters(
        reference, adapter_dirs, tmp_path: Path) -> None:
    names = [*ADAPTERS, BASE, None]  # None: a body without a model runs on the base model too
    lines = [chat_line(f"{name or 'none'}-{q}", question, name) for q, question in enumerate(QUESTIONS)
             for name in names]
    lines += [chat_line("unknown", QUESTIONS[0], "gpt-5"), chat_line("too-big", QUESTIONS[0], "too-big"),
              chat_line("gone", QUESTIONS[0], "gone")]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out"
    code = main(["run", str(source), "--output", str(output), "--database-url", f"sqlite:///{tmp_path / 'db'}",
                 "--shard-size", "4", *FAST, *modules(adapter_dirs, *ADAPTERS, "too-big"),
                 "--lora-modules", f"gone={tmp_path / 'no-such-adapter'}"])
    assert code == 0
    results, errors, manifest = assert_each_id_once(open_store(str(output)), [line["custom_id"] for line in lines])
    assert manifest["counts"] == {"total": len(lines), "completed": len(lines) - 3, "failed": 3}
    served = [line for line in lines if line["custom_id"] not in ("unknown", "too-big", "gone")]
    want = expected(reference, adapter_dirs, [(line["body"]["messages"], _adapter(line)) for line in served])
    got = texts(results)
    assert [got[line["custom_id"]] for line in served] == want
    answers = {name: [got[f"{name or 'none'}-{q}"] for q in range(len(QUESTIONS))] for name in names}
    assert answers[BASE] == answers[None]  # naming the base model or no model: the same rows
    assert all(answers[name] != answers[BASE] for name in ADAPTERS)  # each adapter changes what is said
    failed = {e["custom_id"]: e for e in errors}
    assert failed["unknown"]["code"] == "model_not_found"
    assert "'gpt-5'" in failed["unknown"]["message"] and "'pirate', 'poet', 'sql'" in failed["unknown"]["message"]
    assert failed["too-big"]["code"] == "invalid_adapter" and "rank 32" in failed["too-big"]["message"]
    assert failed["gone"]["code"] == "invalid_adapter" and "no directory" in failed["gone"]["message"]


MALFORMED = {  # adapter name -> its config's change, and what its rows' error says
    "bad-key": ({"alpha_pattern": {"[": 4}}, "alpha_pattern: pattern key '['"),
    "bad-rank-key": ({"rank_pattern": {"[": 4}}, "rank_pattern: pattern key '['"),
    "bad-alphas": ({"alpha_pattern": 5}, "alpha_pattern must be an object"),
    "bad-r": ({"r": "x"}, "r must be a positive integer"),
    "nested-repeat": ({"alpha_pattern": {"(q_proj)+": 4}}, "'(' at 0 is not served"),
}


@pytest.mark.real_model  # runs SmolLM2
def test_a_malformed_adapter_config_fails_its_rows_not_the_shard(adapter_dirs, tmp_path: Path) -> None:
    """Bad pattern keys, a pattern that is not an object, an r that is not a number: each fails the rows naming
    the adapter with invalid_adapter and the reason; the shard holding them (one here) and the job go on."""
    bad = {}
    for name, (change, _) in MALFORMED.items():
        bad[name] = tmp_path / name
        shutil.copytree(adapter_dirs["sql"], bad[name])
        config = json.loads((bad[name] / "adapter_config.json").read_text())
        (bad[name] / "adapter_config.json").write_text(json.dumps({**config, **change}))
    names = ["sql", None, *MALFORMED]
    lines = [chat_line(f"{name or 'none'}-{q}", question, name) for q, question in enumerate(QUESTIONS[:2])
             for name in names]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out"
    code = main(["run", str(source), "--output", str(output), "--database-url", f"sqlite:///{tmp_path / 'db'}",
                 *FAST, *modules(adapter_dirs, "sql"), "--lora-modules",
                 *(f"{name}={directory}" for name, directory in bad.items())])
    assert code == 0
    results, errors, manifest = assert_each_id_once(open_store(str(output)), [line["custom_id"] for line in lines])
    assert manifest["counts"] == {"total": len(lines), "completed": 4, "failed": 2 * len(MALFORMED)}
    assert sorted(texts(results)) == ["none-0", "none-1", "sql-0", "sql-1"]
    for error in errors:
        name = error["custom_id"].rsplit("-", 1)[0]
        assert error["code"] == "invalid_adapter" and MALFORMED[name][1] in error["message"], error


def _adapter(line: dict) -> str | None:
    model = line["body"].get("model")
    return None if model in (None, BASE) else model


def test_run_reads_a_parquet_model_column(reference, adapter_dirs, tmp_path: Path) -> None:
    prompts = ["The capital of France is", "Once upon a time"]
    models = [None, "sql", "poet", BASE]
    rows = [(prompt, model) for prompt in prompts for model in models]
    source = write_parquet(tmp_path / "in.parquet", {"custom_id": [f"r{i}" for i in range(len(rows))],
                                                     "prompt": [p for p, _ in rows], "model": [m for _, m in rows]})
    output = tmp_path / "out"
    assert main(["run", str(source), "--output", str(output), "--database-url", f"sqlite:///{tmp_path / 'db'}",
                 *FAST, *modules(adapter_dirs, "sql", "poet")]) == 0
    results, errors, _ = assert_each_id_once(open_store(str(output)), [f"r{i}" for i in range(len(rows))])
    assert errors == []
    want = expected(reference, adapter_dirs, [(p, None if m == BASE else m) for p, m in rows])
    assert [texts(results)[f"r{i}"] for i in range(len(rows))] == want


def test_run_fetches_an_s3_adapter_into_the_cache(reference, adapter_dirs, seaweedfs: S3Options, s3_prefix: str,
                                                  tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENMILL_DATA", str(tmp_path / "data"))
    store = open_store(f"{s3_prefix}/adapters/poet", seaweedfs)
    for path in adapter_dirs["poet"].iterdir():
        store.put_file(path.name, path)
    lines = [chat_line(f"s3-{q}", question, "s3-poet") for q, question in enumerate(QUESTIONS[:2])]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    output = tmp_path / "out"
    assert main(["run", str(source), "--output", str(output), "--database-url", f"sqlite:///{tmp_path / 'db'}",
                 *FAST, "--lora-modules", f"s3-poet={store.uri}", "--s3-endpoint-url", seaweedfs.endpoint_url]) == 0
    results, errors, _ = assert_each_id_once(open_store(str(output)), ["s3-0", "s3-1"])
    assert errors == []
    want = expected(reference, adapter_dirs, [(line["body"]["messages"], "poet") for line in lines])
    assert [texts(results)[f"s3-{q}"] for q in range(2)] == want
    [entry] = cached_adapters(tmp_path / "data" / "lora-cache")
    assert entry["uri"] == store.uri and Path(entry["path"], "adapter_model.safetensors").is_file()


# ---- the adapter cache, without the model ----------------------------------------------------------------

def test_an_s3_adapter_is_fetched_once_and_again_when_it_changes(adapter_dirs, seaweedfs: S3Options,
                                                                 s3_prefix: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    store = open_store(f"{s3_prefix}/sql", seaweedfs)
    for path in adapter_dirs["sql"].iterdir():
        store.put_file(path.name, path)
    source = AdapterSource(store.uri, seaweedfs)
    first = fetch(source, cache)
    weights = first / "adapter_model.safetensors"
    assert weights.read_bytes() == (adapter_dirs["sql"] / "adapter_model.safetensors").read_bytes()
    fetched_at = weights.stat().st_mtime_ns
    assert fetch(source, cache) == first and weights.stat().st_mtime_ns == fetched_at  # listed, not downloaded
    config = json.loads((adapter_dirs["sql"] / "adapter_config.json").read_text())
    store.put_bytes("adapter_config.json", json.dumps({**config, "lora_alpha": 3}).encode())
    changed = fetch(source, cache)
    assert changed != first and json.loads((changed / "adapter_config.json").read_text())["lora_alpha"] == 3
    assert len(cached_adapters(cache)) == 2

    missing = AdapterSource(f"{s3_prefix}/no-such-adapter", seaweedfs)
    resolved = resolve_adapters(["sql", "missing"], {"sql": source, "missing": missing}, cache)
    assert resolved["sql"].lora_path == str(changed) and resolved["sql"].lora_name == "sql"
    assert isinstance(resolved["missing"], str) and "no objects under" in resolved["missing"]
    again = resolve_adapters(["sql"], {"sql": source}, cache)["sql"]
    assert again.lora_int_id == resolved["sql"].lora_int_id  # stable in this process


def test_the_cache_evicts_the_least_recently_used_adapters_past_its_limit_but_none_in_use(
        seaweedfs: S3Options, s3_prefix: str, tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    sources = {}
    for name in "abcd":
        store = open_store(f"{s3_prefix}/{name}", seaweedfs)
        store.put_bytes("adapter_config.json", b"{}")
        store.put_bytes("adapter_model.safetensors", bytes(1000))
        sources[name] = AdapterSource(store.uri, seaweedfs)
    monkeypatch.setenv("TOKENMILL_LORA_CACHE_BYTES", "2500")  # two entries of 1,002 bytes

    def use(name: str) -> Path:
        time.sleep(0.02)  # file times tick coarsely
        return fetch(sources[name], cache)

    def cached() -> list[str]:
        return sorted(entry["uri"].rsplit("/", 1)[-1] for entry in cached_adapters(cache))

    a, b = use("a"), use("b")
    assert use("a") == a  # a used again: b is the least recently used
    use("c")
    assert cached() == ["a", "c"] and not b.exists()

    time.sleep(0.02)
    held = resolve_adapters(["c"], {"c": sources["c"]}, cache)  # a shard's request: c is in use until it is freed
    use("a")
    use("d")  # c is the least recently used, but in use: a goes
    assert cached() == ["c", "d"] and Path(held["c"].lora_path, "adapter_model.safetensors").is_file()
    del held
    gc.collect()
    use("b")  # c is free now
    assert cached() == ["b", "d"]


# ---- options and specs ---------------------------------------------------------------------------------

def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_lora_modules_take_vllms_forms_and_size_the_engine() -> None:
    args = parse("run", "in.jsonl", "--lora-modules", "a=/x", "b=s3://bucket/b", "--lora-modules",
                 '{"name": "c", "path": "/y", "base_model_name": "smollm2-135m"}')
    assert lora_modules(args) == {"a": "/x", "b": "s3://bucket/b", "c": "/y"}
    assert engine_kwargs(args).items() >= {"enable_lora": True, "max_loras": 3, "max_lora_rank": 16}.items()
    assert "enable_lora" not in engine_kwargs(parse("run", "in.jsonl"))  # no adapters: the engine as before
    many = parse("run", "--lora-modules", *(f"a{i}=/x{i}" for i in range(10)), "--", "in.jsonl")
    assert engine_kwargs(many)["max_loras"] == 8 and engine_kwargs(many)["max_cpu_loras"] == 10
    worker = parse("worker")
    assert engine_kwargs(worker)["enable_lora"] and engine_kwargs(worker)["max_loras"] == 4  # a job's own adapters
    assert "enable_lora" not in engine_kwargs(parse("worker", "--no-enable-lora"))
    assert "enable_lora" not in engine_kwargs(parse("worker", "-tp", "2"))
    with pytest.raises(ValueError, match="twice"):
        lora_modules(parse("run", "in.jsonl", "--lora-modules", "a=/x", "a=/y"))
    with pytest.raises(ValueError, match="--no-enable-lora"):
        engine_kwargs(parse("run", "in.jsonl", "--no-enable-lora", "--lora-modules", "a=/x"))
    with pytest.raises(SystemExit):
        parse("run", "in.jsonl", "--lora-modules", "no-equals-sign")


def test_worker_and_stack_adapters(tmp_path: Path, monkeypatch) -> None:
    from tokenmill.commands.service import _lora_module_args, worker_lora_modules

    monkeypatch.chdir(tmp_path)
    stack = parse("stack", "up", "--lora-modules", "legal=rel/legal", "chat=s3://b/chat")
    args = _lora_module_args(lora_modules(stack))  # the workers run in the state directory: absolute paths
    assert args == ["--lora-modules", f"legal=file://{tmp_path}/rel/legal", "chat=s3://b/chat"]
    assert worker_lora_modules(parse("worker", *args)) == {"legal": f"file://{tmp_path}/rel/legal",
                                                           "chat": "s3://b/chat"}
    with pytest.raises(JobRequestError, match="already names the base model"):
        worker_lora_modules(parse("worker", "--lora-modules", f"{BASE}=/x"))


def test_a_spec_checks_its_adapters() -> None:
    def spec(**fields):
        return validate_request({"input_uri": "s3://b/in.jsonl", "output_uri": "s3://b/out", **fields})

    job = spec(lora_modules={"sql": "s3://b/adapters/sql/"}).to_job(executor=CELERY)
    assert job.settings.lora_modules == {"sql": "s3://b/adapters/sql"}
    assert spec(lora_modules={"sql": "rel/dir"}).lora_modules["sql"].startswith("file:///")  # tokenmill run's
    with pytest.raises(JobRequestError, match="object storage only"):
        spec(lora_modules={"sql": "/srv/adapters/sql"}).to_job(executor=CELERY)  # no paths on the workers' disks
    with pytest.raises(JobRequestError, match="already names the base model"):
        spec(served_model_names=["gpt-4o-mini"], lora_modules={"gpt-4o-mini": "s3://b/a"})
    with pytest.raises(JobRequestError, match="already names the base model"):
        spec(lora_modules={BASE: "s3://b/a"})
    with pytest.raises(JobRequestError, match="adapter name"):
        spec(lora_modules={"../x": "s3://b/a"})
    with pytest.raises(JobRequestError, match="not embeddings"):
        spec(task="embed", lora_modules={"a": "s3://b/a"})


def test_a_parquet_model_column_must_hold_strings(tmp_path: Path) -> None:
    from storage.formats import InputError, Limits
    from storage.formats.parquet import ParquetInput

    good = write_parquet(tmp_path / "good.parquet", {"custom_id": ["a", "b"], "prompt": ["x", "y"],
                                                     "model": ["sql", None]})
    reader = ParquetInput(open(good, "rb"), Limits())
    assert [row.model for row in reader.read(0, 2)] == ["sql", None]
    bad = write_parquet(tmp_path / "bad.parquet", {"custom_id": ["a"], "prompt": ["x"], "model": [3]})
    with pytest.raises(InputError, match="column 'model' must hold strings"):
        ParquetInput(open(bad, "rb"), Limits())
