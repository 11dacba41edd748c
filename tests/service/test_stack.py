"""`tokenmill stack`: a second `up` in a running stack's directory is refused, `env` points a shell at it.
That `down` leaves no process and no open port behind is checked when the session's stack stops
(tests/service/conftest.py)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.real_model


def test_a_second_stack_up_in_the_same_directory_is_refused(stack) -> None:
    again = stack.cli("stack", "up", check=False)
    assert again.returncode == 2
    assert f"a stack already runs from {stack.dir}" in again.stderr
    assert set(stack.state["processes"]) == {"redis", "kv-redis", "worker1", "worker2", "beat", "flower", "consumer",
                                             "watcher", "api"}


def test_stack_env_exports_every_address_and_the_secrets_only_when_asked(stack) -> None:
    exported = stack.cli("stack", "env").stdout
    for name in ("TOKENMILL_BROKER_URL", "TOKENMILL_KAFKA_BOOTSTRAP", "TOKENMILL_BUCKET_URI", "AWS_ENDPOINT_URL_S3",
                 "AWS_ACCESS_KEY_ID", "TOKENMILL_FLOWER_URL", "OPENAI_BASE_URL"):
        assert f"export {name}=" in exported
    secret = ("TOKENMILL_DATABASE_URL", "AWS_SECRET_ACCESS_KEY", "TOKENMILL_FLOWER_AUTH", "OPENAI_API_KEY")
    assert not any(f"export {name}=" in exported for name in secret)
    assert "--show-secrets" in exported and "OPENAI_API_KEY (the openai SDK)" in exported
    shown = stack.cli("stack", "env", "--show-secrets").stdout
    assert all(f"export {name}=" in shown for name in secret)
