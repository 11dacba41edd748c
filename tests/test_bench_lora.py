"""`tokenmill bench lora` end to end on a tiny workload (tokenmill's rows; vLLM's venv absent), and the test adapters
of tokenmill/bench/lora_adapters.py: distinct, the same for the same arguments, made once, and each one changing
Hugging Face + PEFT's greedy text."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tokenmill.bench.lora_adapters import ALL_PROJECTIONS, make_adapters
from tokenmill.cli import main

pytestmark = pytest.mark.real_model


def test_bench_lora_prints_the_base_and_the_adapters_rows(tmp_path, capsys):
    out = tmp_path / "lora.json"
    code = main(["bench", "lora", "--num-prompts", "6", "--min-tokens", "4", "--max-tokens", "12", "--dtypes",
                 "float32", "--num-adapters", "3", "--rank", "8", "--adapters-dir", str(tmp_path / "adapters"),
                 "--against", "vllm", "--vllm-venv", str(tmp_path / "no-venv"), "--json", str(out)])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0, printed
    assert "machine: " in printed and " cores, flags: " in printed
    assert "vLLM is not installed" in printed
    assert "multi-LoRA throughput" in printed and "3 adapters of rank 8" in printed
    rows = {r["system"]: r for r in json.loads(out.read_text())["results"]}
    assert list(rows) == ["tokenmill base", "tokenmill + 3 LoRA"]
    assert all(r["tokens_per_second"] > 0 and r["useful_tokens"] >= 6 * 4 for r in rows.values())
    assert [rows[name]["adapters"] for name in rows] == [0, 3]
    share = rows["tokenmill + 3 LoRA"]["tokens_per_second"] / rows["tokenmill base"]["tokens_per_second"]
    assert f"{100 * share:.0f}%" in printed
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["lora-0", "lora-1", "lora-2"]


def test_make_adapters_are_distinct_seeded_made_once_and_change_the_greedy_text(tmp_path, tokenizer):
    from tests.engine.lora_reference import hf_peft_greedy
    from tokenmill.bench.workload import chat_ids

    dirs = make_adapters(tmp_path / "a", 2, rank=4, seed=5)
    config = json.loads((dirs[0] / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == sorted(ALL_PROJECTIONS)
    weights = [load_file(d / "adapter_model.safetensors") for d in dirs]
    assert weights[0].keys() == weights[1].keys() and len(weights[0]) == 2 * 30 * len(ALL_PROJECTIONS)
    assert all(w.abs().sum() > 0 for w in weights[0].values())  # no zero B: the adapter is not a no-op
    assert any(not weights[0][k].equal(weights[1][k]) for k in weights[0])
    made = (dirs[0] / "adapter_model.safetensors").stat().st_mtime_ns
    assert make_adapters(tmp_path / "a", 2, rank=4, seed=5) == dirs  # made once
    assert (dirs[0] / "adapter_model.safetensors").stat().st_mtime_ns == made
    again = load_file(make_adapters(tmp_path / "b", 1, rank=4, seed=5)[0] / "adapter_model.safetensors")
    assert all(again[k].equal(weights[0][k]) for k in again)  # the same arguments, the same weights

    prompts = [chat_ids(tokenizer, q) for q in ("What is a haiku?", "Why do cats purr?", "Describe the water cycle.")]
    base = hf_peft_greedy(None, prompts, 16)
    outputs = [hf_peft_greedy(d, prompts, 16) for d in dirs]
    for adapter in outputs:
        assert sum(a != b for a, b in zip(adapter, base, strict=True)) >= 2
    assert outputs[0] != outputs[1]
    text = tokenizer.decode(outputs[0][0])
    assert sum(ch.isalpha() or ch.isspace() for ch in text) > 0.8 * len(text), text  # still text
    other = load_file(make_adapters(tmp_path / "a", 1, rank=4, seed=6)[0] / "adapter_model.safetensors")
    assert not other[next(iter(other))].equal(weights[0][next(iter(other))])  # a new seed rebuilds the directory
