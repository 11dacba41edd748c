"""The memory plan on CPU counts everything it allocates: weights, activations, the KV pool and the draft's."""

import logging

import pytest

from engine import LLM
from engine.config import CPU_KV_CACHE_SPACE_ENV, EngineConfig


def test_the_kv_budget_covers_the_draft_pool_and_the_total_stays_within_the_logged_budget(model_dir, caplog):
    space = 48 << 20
    with caplog.at_level(logging.INFO, logger="tokenmill.engine"):
        llm = LLM(str(model_dir), num_threads=2, max_model_len=512, cpu_kv_cache_space=space,
                  speculative_config={"method": "self", "num_speculative_tokens": 2, "draft_layers": 6})
    runner = llm.engine.runner
    plan = runner.kv_plan
    target_pool = sum(t.nbytes for t in runner.attention.k_caches + runner.attention.v_caches)
    draft = llm.engine.spec.draft
    draft_pool = sum(t.nbytes for t in draft.attention.k_caches + draft.attention.v_caches)
    assert target_pool == plan.num_blocks * plan.bytes_per_block
    assert draft_pool == plan.num_blocks * plan.draft_bytes_per_block == target_pool * 6 // 30
    per_block = plan.bytes_per_block + plan.draft_bytes_per_block
    assert target_pool + draft_pool <= space < target_pool + draft_pool + per_block
    weights = sum(p.nbytes for p in runner.model.parameters())
    assert plan.weights_bytes == weights
    assert weights + plan.activation_bytes + target_pool + draft_pool == plan.total_bytes <= plan.budget_bytes
    logged = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
    assert f"total {plan.total_bytes / 2**20:.0f} MiB of a {plan.budget_bytes / 2**20:.0f} MiB budget" in logged
    assert "draft KV" in logged


def test_the_default_cpu_pool_is_read_from_the_environment_in_gib(monkeypatch):
    monkeypatch.delenv(CPU_KV_CACHE_SPACE_ENV, raising=False)
    assert EngineConfig().cpu_kv_cache_space == 4 << 30
    monkeypatch.setenv(CPU_KV_CACHE_SPACE_ENV, "0.5")
    assert EngineConfig().cpu_kv_cache_space == 1 << 29
    assert EngineConfig(cpu_kv_cache_space=3 << 20).cpu_kv_cache_space == 3 << 20  # given: the variable is not read
    for bad in ("0", "-1", "lots", "inf"):
        monkeypatch.setenv(CPU_KV_CACHE_SPACE_ENV, bad)
        with pytest.raises(ValueError, match=CPU_KV_CACHE_SPACE_ENV):
            EngineConfig()
