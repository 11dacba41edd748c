"""`tokenmill stack env`: the OpenAI SDK's variables, and what a shell lacks without --show-secrets (no stack is
started: the state file is written here)."""

from __future__ import annotations

from tokenmill.stack import Stack, StackSettings, _initial_state, env_script


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
