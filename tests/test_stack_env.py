"""`tokenmill stack env`: the OpenAI and Anthropic SDKs' variables, and what a shell lacks without --show-secrets
(no stack is started: the state file is written here)."""

from __future__ import annotations

from tokenmill.stack.local_stack import Stack, StackSettings, _initial_state, env_script


def test_stack_env_exports_the_openai_variables_and_names_what_lacks_credentials(tmp_path) -> None:
    stack = Stack(tmp_path)
    stack.state = _initial_state(StackSettings(tmp_path, port_base=20000))
    stack.state["env"].update(OPENAI_API_KEY="tm-secret", ANTHROPIC_API_KEY="tm-secret")
    stack.save()
    assert stack.state["env"]["OPENAI_BASE_URL"] == "http://127.0.0.1:20003/v1"
    assert stack.state["env"]["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:20003"
    assert stack.state["ports"]["api"] == 20003

    plain = env_script(tmp_path)
    assert "export OPENAI_BASE_URL=http://127.0.0.1:20003/v1" in plain and "tm-secret" not in plain
    assert "export ANTHROPIC_BASE_URL=http://127.0.0.1:20003" in plain
    note = plain.splitlines()[-1]
    for hidden in ("TOKENMILL_DATABASE_URL (psql)", "AWS_SECRET_ACCESS_KEY (aws s3 and boto3)",
                   "TOKENMILL_FLOWER_AUTH (curl to Flower)", "OPENAI_API_KEY (the openai SDK)",
                   "ANTHROPIC_API_KEY (the anthropic SDK)", "--show-secrets"):
        assert hidden in note, note

    shown = env_script(tmp_path, show_secrets=True)
    assert "export OPENAI_API_KEY=tm-secret" in shown and "export ANTHROPIC_API_KEY=tm-secret" in shown
    assert "not shown" not in shown


def test_job_commands_read_a_running_stacks_database_and_say_which(tmp_path, monkeypatch, capsys) -> None:
    import json

    from tokenmill.cli import main
    from tokenmill.commands.jobs import database_option

    monkeypatch.setenv("TOKENMILL_DATABASE_URL", "unset-after-the-test")
    monkeypatch.delenv("TOKENMILL_DATABASE_URL")
    monkeypatch.setenv("TOKENMILL_DATA", str(tmp_path / "data"))
    (tmp_path / "data" / "stack").mkdir(parents=True)
    stack_db = tmp_path / "stack.db"
    (tmp_path / "data" / "stack" / "stack.json").write_text(
        json.dumps({"env": {"TOKENMILL_DATABASE_URL": f"sqlite:///{stack_db}"}}))

    assert main(["status", "nope"]) == 2
    assert f"no job matches 'nope' in database {stack_db}" in capsys.readouterr().err
    monkeypatch.setenv("COLUMNS", "400")  # rich wraps a long path mid-word (xdist's folders are longer)
    assert main(["jobs"]) == 0 and f"no jobs yet in {stack_db}" in " ".join(capsys.readouterr().out.split())

    assert database_option(None) == ""
    assert database_option(f"sqlite:///{stack_db}") == f" --database-url sqlite:///{stack_db}"
    assert database_option("postgresql+psycopg://u:pw@h/db") == " --database-url 'postgresql+psycopg://u:***@h/db'"


def test_the_stacks_kv_store_is_a_capped_redis_of_its_own_with_a_password_and_a_secret(tmp_path) -> None:
    """Issue #56: KV blocks never go to the broker's Redis; their own has a password, a memory cap and LRU eviction
    (a cap on the broker's would evict or refuse its queues); every worker gets the deployment's KV secret."""
    import shutil
    import socket
    import stat
    import subprocess
    import time

    import pytest
    import redis

    from tokenmill.stack.local_stack import SECRET_VARIABLES, _kv_store_config

    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server binary")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stack = Stack(tmp_path)
    stack.state = _initial_state(StackSettings(tmp_path, port_base=port - 5, kv_store_memory_mib=64))
    env = stack.state["env"]
    assert len(env["TOKENMILL_KV_SECRET"]) >= 32
    assert {"TOKENMILL_KV_SECRET", "TOKENMILL_KV_REDIS_URL"} <= set(SECRET_VARIABLES)
    kv_url = redis.connection.parse_url(env["TOKENMILL_KV_REDIS_URL"])
    assert kv_url["port"] == port != stack.state["ports"]["redis"] and kv_url["password"]
    assert env["TOKENMILL_KV_REDIS_URL"] != env["TOKENMILL_BROKER_URL"]

    config = _kv_store_config(stack, port)
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    server = subprocess.Popen(["redis-server", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis.from_url(env["TOKENMILL_KV_REDIS_URL"], socket_timeout=2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert client.config_get("maxmemory")["maxmemory"] == str(64 * 2**20)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        client.close()
        anonymous = redis.Redis(port=port, socket_timeout=2)
        with pytest.raises(redis.AuthenticationError):
            anonymous.get("anything")
        anonymous.close()
    finally:
        server.terminate()
        server.wait(10)
