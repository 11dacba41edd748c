"""`tokenmill stack env`: the OpenAI SDK's variables, and what a shell lacks without --show-secrets (no stack is
started: the state file is written here)."""

from __future__ import annotations

from tokenmill.stack.local_stack import Stack, StackSettings, _initial_state, env_script


def test_stack_env_exports_the_openai_variables_and_names_what_lacks_credentials(tmp_path) -> None:
    stack = Stack(tmp_path)
    stack.state = _initial_state(StackSettings(tmp_path, port_base=20000))
    stack.state["env"]["OPENAI_API_KEY"] = "tm-secret"
    stack.save()
    assert stack.state["env"]["OPENAI_BASE_URL"] == "http://127.0.0.1:20003/v1"
    assert stack.state["ports"]["api"] == 20003

    plain = env_script(tmp_path)
    assert "export OPENAI_BASE_URL=http://127.0.0.1:20003/v1" in plain and "tm-secret" not in plain
    note = plain.splitlines()[-1]
    for hidden in ("TOKENMILL_DATABASE_URL (psql)", "AWS_SECRET_ACCESS_KEY (aws s3 and boto3)",
                   "TOKENMILL_FLOWER_AUTH (curl to Flower)", "OPENAI_API_KEY (the openai SDK)", "--show-secrets"):
        assert hidden in note, note

    shown = env_script(tmp_path, show_secrets=True)
    assert "export OPENAI_API_KEY=tm-secret" in shown and "not shown" not in shown


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
    assert main(["jobs"]) == 0 and f"no jobs yet in {stack_db}" in " ".join(capsys.readouterr().out.split())

    assert database_option(None) == ""
    assert database_option(f"sqlite:///{stack_db}") == f" --database-url sqlite:///{stack_db}"
    assert database_option("postgresql+psycopg://u:pw@h/db") == " --database-url 'postgresql+psycopg://u:***@h/db'"
