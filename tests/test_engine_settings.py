"""The engine settings' one table (engine/settings.py): the flags and help of every command that takes engine
options come from it, and the typed settings go from the command line to a worker's environment and a job's stored
settings and back, a bad value failing with the setting's name."""

from __future__ import annotations

import os

import pytest

from engine.settings import ENGINE_SETTINGS, EngineSettings
from tokenmill.cli import build_parser
from tokenmill.options import engine_kwargs, engine_settings
from workers.worker_engine import WorkerEngine


def subparser(name: str):
    return next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction").choices[name]


@pytest.mark.parametrize("command", ["run", "worker", "api"])
def test_every_knob_is_a_flag_with_its_help(command: str) -> None:
    text = " ".join(subparser(command).format_help().split())
    for knob in ENGINE_SETTINGS:
        if knob.lora and command == "api":
            continue
        assert knob.flags[0] in text, (command, knob.flags[0])
        first_words = " ".join(knob.help.split()[:4]).split("%")[0].split("{")[0]
        assert first_words in text, (command, knob.dest)


def test_a_command_default_is_in_its_help() -> None:
    worker = " ".join(subparser("worker").format_help().split())
    assert "latest arrival) (default: priority)" in worker
    assert engine_settings(build_parser().parse_args(["worker"]))["scheduling_policy"] == "priority"
    assert engine_settings(build_parser().parse_args(["run", "in.jsonl"]))["scheduling_policy"] == "fcfs"


def test_settings_go_through_the_workers_environment_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["worker", "--kv-cache-memory", "0.5", "--preemption-mode", "swap",
                                      "--speculative-method", "draft", "--draft-model", "d", "-pp", "1"])
    settings = engine_settings(args)
    assert settings["kv_cache_memory"] == 2**29 and settings["preemption_mode"] == "swap"  # GiB -> bytes
    assert "pipeline_parallel_size" not in settings and "kv_cache_dtype" not in settings  # only when set
    assert settings["speculative_config"] == {"method": "draft", "num_speculative_tokens": 5, "model": "d"}
    monkeypatch.setenv("TOKENMILL_WORKER_ENGINE", settings.dumps())
    monkeypatch.setenv("TOKENMILL_WORKER_MODEL", "smollm2-135m")
    spec = WorkerEngine.from_env()
    assert isinstance(spec.settings, EngineSettings) and spec.settings == settings
    assert spec.settings.config().kv_cache_memory == 2**29


@pytest.mark.parametrize(("text", "message"), [
    ('{"max_num_seqs": "4"}', "TOKENMILL_WORKER_ENGINE: engine setting max_num_seqs must be int, got str '4'"),
    ('{"enable_prefix_caching": 1}', "engine setting enable_prefix_caching must be bool, got int 1"),
    ('{"swap_space": true}', "engine setting swap_space must be float, got bool True"),
    ('{"kv_cache_mem": 1}', "unknown engine setting(s): kv_cache_mem"),
    ('[1]', "TOKENMILL_WORKER_ENGINE must be a JSON object of engine settings, got list"),
    ('{x', "TOKENMILL_WORKER_ENGINE must be a JSON object of engine settings: Expecting"),
])
def test_a_bad_worker_setting_fails_naming_it(monkeypatch: pytest.MonkeyPatch, text: str, message: str) -> None:
    monkeypatch.setenv("TOKENMILL_WORKER_ENGINE", text)
    with pytest.raises(ValueError) as raised:
        WorkerEngine.from_env()
    assert message in str(raised.value)


def test_the_kv_secret_is_added_for_an_engine_and_never_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENMILL_KV_SECRET", "s" * 32)
    transfer = '{"kv_connector": "RedisConnector", "kv_connector_extra_config": {"redis_url": "redis://h"}}'
    args = build_parser().parse_args(["run", "in.jsonl", "--kv-transfer-config", transfer])
    assert engine_kwargs(args)["kv_transfer_config"]["kv_connector_extra_config"]["kv_secret"] == "s" * 32
    stored = EngineSettings(engine_kwargs(args))
    assert "kv_secret" not in stored.to_json()["kv_transfer_config"]["kv_connector_extra_config"]
    assert "sss" not in repr(stored)
    given = transfer.replace('"redis://h"', '"redis://h", "kv_secret": "t"')
    with pytest.raises(ValueError, match="give the KV secret in TOKENMILL_KV_SECRET"):
        engine_settings(build_parser().parse_args(["run", "in.jsonl", "--kv-transfer-config", given]))


def test_tokenmill_worker_hands_its_celery_app_the_typed_engine_and_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers import celery_app

    for name in ("TOKENMILL_WORKER_ENGINE", "TOKENMILL_WORKER_MODEL", "TOKENMILL_ENGINE_FACTORY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TOKENMILL_WORKER_CHILD", "engine")
    monkeypatch.setattr(celery_app.app, "worker_main", lambda argv: None)
    monkeypatch.setattr(celery_app.app, "tokenmill", None, raising=False)
    args = build_parser().parse_args(["worker", "--max-num-seqs", "8", "--no-enable-lora", "--engine-factory",
                                      "tests.service.faulty_engine:load"])
    args.argv = []
    assert args.handler(args) == 0
    process = celery_app.worker_process()
    from tests.service.faulty_engine import load

    assert process.factory is load and process.spec.settings["max_num_seqs"] == 8
    assert isinstance(process.spec.settings, EngineSettings) and "TOKENMILL_WORKER_ENGINE" not in os.environ
    with pytest.raises(ValueError, match="engine factory 'no.such:thing'"):
        args.handler(build_parser().parse_args(["worker", "--engine-factory", "no.such:thing"]))
