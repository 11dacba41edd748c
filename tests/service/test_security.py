"""Who may read and write where, on the real stack: the front doors' allow-lists and key checks, models by
name only, bounds on every value (a bad one fails its row or its message, never a shard or a front door),
the stack's credentials (a role that is not a superuser, random S3 keys, no secret in logs, manifests,
events, metrics or `tokenmill status`), and cache salts that keep tenants' prefix-cache blocks apart."""

from __future__ import annotations

import json
import os
import stat
import uuid
from pathlib import Path

import pytest
from sqlalchemy import text

from ingest.submit import send
from tests.jobs.jobhelpers import assert_each_id_once, prompt_rows, write_parquet
from tests.scrape import metrics_when_up
from tests.service.conftest import job_events, job_row, tokenmill, wait_for_job, wait_until

pytestmark = pytest.mark.real_model
TOPIC = "tokenmill.jobs"


def rejection(sessions, offset: int) -> str | None:
    with sessions() as session:
        return session.scalar(text('SELECT error FROM rejected_messages WHERE topic = :t AND "offset" = :o'),
                              {"t": TOPIC, "o": offset})


def job_of_offset(sessions, offset: int) -> dict | None:
    with sessions() as session:
        row = session.execute(text("SELECT * FROM jobs WHERE source_ref = :ref"),
                              {"ref": f"{TOPIC}/0/{offset}"}).mappings().one_or_none()
        return dict(row) if row else None


def outcomes(stack, sessions, specs: list[dict | bytes]) -> list[tuple[str, str]]:
    """Send each spec; ('job', id) or ('rejected', error) for each, once the consumer recorded them all."""
    offsets = [send(stack.bootstrap, TOPIC, spec).offset for spec in specs]

    def recorded():
        found = []
        for offset in offsets:
            error = rejection(sessions, offset)
            job = None if error else job_of_offset(sessions, offset)
            if error is None and job is None:
                return None
            found.append(("rejected", error) if error else ("job", job["id"]))
        return found

    return wait_until(recorded, "the consumer to record every message", timeout=120)


def inbox_record(sessions, key: str) -> tuple[str | None, str | None] | None:
    with sessions() as session:
        return session.execute(text("SELECT job_id, error FROM inbox_objects WHERE key = :k"), {"k": key}).one_or_none()


# ---- 1. allow-lists and keys -------------------------------------------------------------------------

def test_front_doors_read_and_write_only_in_the_stacks_bucket(stack, sessions, tmp_path) -> None:
    tag = uuid.uuid4().hex[:8]
    rows = [{"custom_id": "a", "prompt": "Hi"}]
    local_out = tmp_path / f"out-{tag}"
    secret = tmp_path / "secret.parquet"
    write_parquet(secret, prompt_rows(1, "secret"))
    bad = [
        {"rows": rows, "output_uri": str(local_out)},  # a local folder on the workers
        {"rows": rows, "output_uri": f"file://{local_out}"},
        {"input_uri": str(secret), "output_uri": f"{stack.bucket}/ok-{tag}"},  # a local file
        {"input_uri": "s3://another-bucket/in.parquet", "output_uri": f"{stack.bucket}/ok-{tag}"},
        {"input_uri": f"{stack.bucket}/inbox/../private/in.parquet", "output_uri": f"{stack.bucket}/x-{tag}"},
        {"rows": rows, "output_uri": f"{stack.bucket}/a//b-{tag}"},
        {"rows": rows, "output_uri": f"{stack.bucket}/bell\x07-{tag}"},
        {"rows": rows, "output_uri": f"{stack.bucket}/" + "k" * 1100},
    ]
    good = {"rows": rows, "output_uri": f"{stack.bucket}/allowed-{tag}", "sampling": {"max_tokens": 2}}
    found = outcomes(stack, sessions, [*bad, good])
    assert [kind for kind, _ in found] == ["rejected"] * len(bad) + ["job"], found
    errors = [error for _, error in found[:len(bad)]]
    assert all("outside the allowed prefixes" in e for e in errors[:4]), errors[:4]
    assert "output_uri" in errors[0] and "input_uri" in errors[2] and "TOKENMILL_ALLOWED_INPUT_PREFIXES" in errors[3]
    assert all("segment" in e for e in errors[4:6]) and "control characters" in errors[6] and "1024" in errors[7]
    assert not local_out.exists(), "nothing may be written outside the allow-list"
    assert wait_for_job(sessions, found[-1][1])["status"] == "completed"


def test_long_and_malformed_inbox_keys_are_recorded_and_the_watcher_goes_on(stack, sessions, tmp_path) -> None:
    """A key of 240+ characters (its derived idempotency key and output folder would overflow) becomes a
    job; keys with empty segments or control characters (as the S3 server keeps them) are recorded with their
    error; a file after them is still taken."""
    from storage.objectstore import UnsafeURI, check_key

    source = write_parquet(tmp_path / "in.parquet", prompt_rows(1, "long"))
    inbox = stack.store(f"{stack.bucket}/inbox")
    tag = uuid.uuid4().hex[:8]
    long_name = f"t-{tag}/" + "d" * 120 + "/long-" + "x" * 120  # SeaweedFS takes 255 bytes per segment
    inbox.put_bytes(f"{long_name}.job.json", json.dumps({"sampling": {"max_tokens": 2}}).encode())
    inbox.put_file(f"{long_name}.parquet", source)
    for name in (f"t-{tag}//empty.parquet", f"t-{tag}/tab\t.parquet", f"t-{tag}/dot/./x.parquet",
                 f"t-{tag}/bell\x07.parquet"):
        try:
            inbox.put_file(name, source)
        except Exception:  # a key the S3 server refuses never reaches the watcher
            continue
    inbox.put_file(f"after-{tag}.parquet", source)
    kept = [key for key in inbox.list(f"t-{tag}") if not key.endswith(".job.json")]
    assert len(kept) >= 3, kept

    def refused(key: str) -> bool:
        try:
            check_key(f"inbox/{key}")
            return False
        except UnsafeURI:
            return True

    records = {key: wait_until(lambda k=key: inbox_record(sessions, f"inbox/{k}"), f"the watcher to record {key!r}",
                               timeout=90) for key in [*kept, f"after-{tag}.parquet"]}
    for key, (job_id, error) in records.items():
        if refused(key):
            assert job_id is None and ("segment" in error or "control characters" in error), (key, error)
        else:
            assert job_id is not None and error is None, (key, error)
    assert any(refused(key) for key in kept), f"the S3 server kept no malformed key: {kept}"
    job = wait_for_job(sessions, records[f"{long_name}.parquet"][0])
    assert job["status"] == "completed", job["error"]
    assert len(job["idempotency_key"]) <= 255 and len(job["output_uri"]) < len(stack.bucket) + 140


# ---- 2. models by name only ----------------------------------------------------------------------------

def test_a_spec_names_a_registered_model_never_a_path(stack, sessions, model_dir) -> None:
    base = {"rows": [{"custom_id": "a", "prompt": "Hi"}], "output_uri": f"{stack.bucket}/m-{uuid.uuid4().hex[:8]}"}
    found = outcomes(stack, sessions, [
        {**base, "model": str(model_dir)},
        {**base, "model": "not-installed-7b"},
        {**base, "speculative_config": {"method": "draft", "model": str(model_dir)}},
    ])
    assert [kind for kind, _ in found] == ["rejected"] * 3
    assert "model: " in found[0][1] and "is not a model name" in found[0][1]
    assert "unknown model 'not-installed-7b'" in found[1][1] and "smollm2-135m" in found[1][1]
    assert "speculative_config.model" in found[2][1] and "is not a model name" in found[2][1]


# ---- 3. bounds -----------------------------------------------------------------------------------------

def test_values_out_of_bounds_fail_their_row_or_their_message_never_a_shard(stack, sessions, tmp_path) -> None:
    tag = uuid.uuid4().hex[:8]
    spec = {"rows": [{"custom_id": "a", "prompt": "Hi"}], "output_uri": f"{stack.bucket}/b-{tag}"}
    found = outcomes(stack, sessions, [
        {**spec, "shard_size": 10**7}, {**spec, "priority": 2**31}, {**spec, "sampling": {"top_k": 2**40}},
        {**spec, "sampling": {"stop": [f"s{i}" for i in range(40)]}}, {**spec, "sampling": {"seed": 2**64}},
        {**spec, "cache_salt": "s" * 300}, json.dumps({**spec, "sampling": {"temperature": 1e400}}).encode(),
        {**spec, "speculative_config": {"method": "ngram", "prompt_lookup_max": 10**9}},
    ])
    assert [kind for kind, _ in found] == ["rejected"] * 8, found
    for (_, error), field in zip(found, ["shard_size", "priority", "top_k", "stop", "seed", "cache_salt",
                                         "temperature", "prompt_lookup_max"], strict=True):
        assert field in error, (field, error)

    rows = {"custom_id": ["ok-1", "k" * 600, "big-top-k", "many-messages", "ok-2"],
            "messages": [[{"role": "user", "content": "Hi"}]] * 2 + [[{"role": "user", "content": "Hello"}]]
            + [[{"role": "user", "content": "x"}] * 2000] + [[{"role": "user", "content": "Bye"}]],
            "top_k": [None, None, 60_000, None, 5]}
    source = write_parquet(tmp_path / "bounds.parquet", rows)
    inbox = stack.store(f"{stack.bucket}/inbox")
    name = f"bounds-{tag}"
    inbox.put_bytes(f"{name}.job.json", json.dumps({"sampling": {"max_tokens": 2}, "shard_size": 5}).encode())
    inbox.put_file(f"{name}.parquet", source)
    job_id, error = wait_until(lambda: inbox_record(sessions, f"inbox/{name}.parquet"), "the watcher", timeout=90)
    job = wait_for_job(sessions, job_id)
    assert job["status"] == "completed" and (job["requests_completed"], job["requests_failed"]) == (2, 3), job
    with sessions() as session:
        failed = {r.code: r.message for r in session.execute(text(
            "SELECT code, message FROM row_errors WHERE job_id = :id"), {"id": job_id})}
    assert "custom_id is 600 characters long" in failed["invalid_custom_id"]
    assert "top_k must be at most the vocabulary size" in failed["invalid_parameter"]
    assert "2000 messages, over the limit of 1024" in failed["invalid_messages"]

    big = f"big-sidecar-{tag}"  # over TOKENMILL_MAX_SPEC_BYTES (256 KiB in these tests): refused unread
    inbox.put_bytes(f"{big}.job.json", b'{"sampling": {"max_tokens": 2}, "pad": "' + b"x" * 300_000 + b'"}')
    inbox.put_file(f"{big}.parquet", write_parquet(tmp_path / "big.parquet", prompt_rows(1, "big")))
    job_id, error = wait_until(lambda: inbox_record(sessions, f"inbox/{big}.parquet"), "the watcher", timeout=90)
    assert job_id is None and "too large" in error and "TOKENMILL_MAX_SPEC_BYTES" in error


# ---- 4. credentials ------------------------------------------------------------------------------------

def secrets_of(stack) -> dict[str, str]:
    from sqlalchemy.engine import make_url

    env = stack.state["env"]
    return {"database password": make_url(env["TOKENMILL_DATABASE_URL"]).password,
            "S3 secret key": env["AWS_SECRET_ACCESS_KEY"], "Flower password": stack.state["flower"]["password"],
            "API key": env["OPENAI_API_KEY"]}


def test_the_stack_runs_with_its_own_credentials_and_never_shows_them(stack, sessions, kafka_job) -> None:
    from tokenmill.stack.local_stack import describe

    secrets = secrets_of(stack)
    assert all(len(value) >= 16 for value in secrets.values()), "random secrets"
    assert stack.state["env"]["AWS_ACCESS_KEY_ID"] != "tokenmill"
    with sessions() as session:
        role, superuser, create_db, create_role = session.execute(text(
            "SELECT rolname, rolsuper, rolcreatedb, rolcreaterole FROM pg_roles WHERE rolname = current_user")).one()
    assert role.endswith("_service") and not (superuser or create_db or create_role)
    for path in (stack.dir / "stack.json", stack.dir / "stack.env", stack.dir / "seaweedfs" / "s3.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    shown = stack.cli("stack", "env", "--show-secrets").stdout
    assert all(value in shown for value in secrets.values())

    texts = {"tokenmill stack env": stack.cli("stack", "env").stdout,
             "stack up's description": describe(stack.state, stack.dir),
             "tokenmill status": tokenmill("status", kafka_job.id, env=stack.env).stdout,
             "tokenmill status --json": tokenmill("status", kafka_job.id, "--json", env=stack.env).stdout,
             "job events": json.dumps(job_events(stack, kafka_job.id)),
             "manifest": stack.store(kafka_job.output_uri).get_bytes("manifest.json").decode(),
             "job row": json.dumps(job_row(sessions, kafka_job.id), default=str)}
    ports = stack.state["ports"]
    for port in range(ports["metrics"], ports["metrics"] + stack.state["workers"] + 1):  # the workers', then beat's
        url = f"http://127.0.0.1:{port}/metrics"
        texts[f"metrics :{port}"] = wait_until(lambda url=url: metrics_when_up(url), f"the metrics endpoint {url}",
                                               timeout=180)
    for path in stack.dir.rglob("*.log"):
        texts[str(path)] = path.read_text(errors="replace")
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            if os.getpgid(int(pid)) in stack.state["processes"].values():
                texts[f"command line of {pid}"] = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except (OSError, ProcessLookupError):
            continue
    assert len([k for k in texts if k.endswith(".log")]) >= 6 and any(k.startswith("command") for k in texts)
    leaks = [(where, name) for where, content in texts.items() for name, value in secrets.items() if value in content]
    assert not leaks, f"secrets shown: {leaks}"


# ---- 5. cache salts ------------------------------------------------------------------------------------

def test_tenants_of_the_inbox_never_share_prefix_cache_blocks(stack, sessions, tmp_path) -> None:
    """A first tenant's job leaves its prompts' blocks in both workers' caches (one row per shard); the same
    prompt from another inbox folder (another tenant) then hits none of them, while from the first tenant's
    folder it does."""
    preamble = "You are a careful assistant. Read the following instructions twice before answering. " * 4
    rows = {"custom_id": [f"salt-{i}" for i in range(6)],
            "prompt": [f"{preamble}Question {i}: name a colour." for i in range(6)]}
    inbox = stack.store(f"{stack.bucket}/inbox")
    tag = uuid.uuid4().hex[:8]

    def drop(tenant: str, name: str, count: int) -> str:
        source = write_parquet(tmp_path / f"{name}.parquet", {k: v[:count] for k, v in rows.items()})
        inbox.put_bytes(f"{tenant}/{name}.job.json", json.dumps({"sampling": {"max_tokens": 2},
                                                                 "shard_size": 1}).encode())
        inbox.put_file(f"{tenant}/{name}.parquet", source)
        job_id, error = wait_until(lambda: inbox_record(sessions, f"inbox/{tenant}/{name}.parquet"), "the watcher",
                                   timeout=90)
        assert error is None, error
        return job_id

    first = wait_for_job(sessions, drop(f"tenant-a-{tag}", "first", 6))
    with sessions() as session:
        workers = session.scalars(text("SELECT DISTINCT worker FROM shards WHERE job_id = :id"), {"id": first["id"]})
        assert len(set(workers)) == 2, "the first job's shards should have run on both workers"
    again_id, other_id = drop(f"tenant-a-{tag}", "again", 1), drop(f"tenant-b-{tag}", "other", 1)
    again, other = wait_for_job(sessions, again_id), wait_for_job(sessions, other_id)
    assert all(job["status"] == "completed" for job in (first, again, other))
    salts = [job["settings"]["cache_salt"] for job in (first, again, other)]
    assert salts[0] == salts[1] != salts[2] and all(salts)
    assert other["cached_tokens"] == 0, "another tenant's job must not hit the first tenant's blocks"
    assert again["cached_tokens"] >= 16, "the same tenant's job reuses its cached preamble"
    assert_each_id_once(stack.store(other["output_uri"]), ["salt-0"])
