"""An adapter's config as the engine reads it (engine/lora/adapter.py, engine/lora/patterns.py): `rank_pattern` /
`alpha_pattern` keys match modules as PEFT's `get_pattern_key` does, in linear time, so no key can hang a worker;
a malformed config or weights file is a ValueError naming the adapter and the problem (its requests fail alone);
the scaling of each module is PEFT's own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from engine.lora.adapter import load_adapter
from engine.lora.patterns import PatternError, PatternKey

TINY = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, intermediate_size=16,
                       num_hidden_layers=2)
MODULES = [f"model.layers.{layer}.{block}.{name}" for layer in (0, 1, 7, 12, 29)
           for block, name in [("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"),
                               ("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"),
                               ("mlp", "down_proj")]] + ["q_proj", "layers.0.q_proj", "a.b", ""]
PEFT_FORMS = ["q_proj", "proj", "model.layers.0.self_attn.q_proj", "^model.layers.0.self_attn.q_proj", "^layers.0",
              r".*\.q_proj", ".*q_proj", r"layers\.\d+\.self_attn\.q_proj", "model.layers.[0-9]+.mlp.down_proj",
              r"layers.1\d*.mlp.up_proj", "q_proj|v_proj", r"layers\.[12]?\d\.mlp\.down_proj$", "[qkv]_proj",
              "[^q]_proj", r"\w+_proj", r".+\.o_proj", "self_attn.q_proj", "attn.q_proj", "mlp", r"0\..*", "^model",
              "q_proj$", "layers.1.*gate_proj", "[-a]_proj", r"layers\.2?9\..*", "q_pro?j", "up_pr+oj", "dow*n_proj",
              ".*", ".+", "gate_proj*?", "x|"]


def tiny_adapter(directory: Path, config: dict, rank: int = 2, modules=("q_proj", "v_proj")) -> str:
    """A PEFT-named adapter for TINY: lora_A / lora_B of `rank` on `modules` of both layers, and `config`."""
    directory.mkdir(parents=True)
    sizes = {"q_proj": 8, "k_proj": 4, "v_proj": 4}
    tensors = {}
    for layer in range(2):
        for module in modules:
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.ones(rank, 8)
            tensors[f"{key}.lora_B.weight"] = torch.ones(sizes[module], rank)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                               "target_modules": list(modules), **config}))
    return str(directory)


def scales(adapter) -> dict[tuple[int, str], float]:
    """Each (layer, module)'s scaling, read back from the effective B (B is all ones)."""
    out = {}
    for (layer, _), (_, b) in adapter.weights.items():
        out[(layer, "q_proj")] = float(b[0, 0])
        out[(layer, "v_proj")] = float(b[2 * 16, 12])  # part 2 (v) at rank offset 2 * max_rank, columns 8 + 4
    return out


def test_keys_match_modules_as_peft_does():
    from peft.utils.other import get_pattern_key

    for key in PEFT_FORMS:
        compiled = PatternKey(key)
        for module in MODULES:
            peft_matches = re.match(rf"(.*\.)?({key})$", module) is not None  # get_pattern_key's test
            if key != module:
                assert peft_matches == (get_pattern_key([key], module) == key)
            assert compiled.matches(module) == peft_matches, (key, module)


@pytest.mark.parametrize("key", ["(a+)+$", "(.|.|.|.)*Z", "(?:x)", "a{2}", "[", r"\bq", "a**", "(?=q)", r"(q)\1"])
def test_keys_outside_the_served_forms_are_refused(key):
    with pytest.raises(PatternError, match="pattern key"):
        PatternKey(key)


def test_a_pathological_key_is_matched_in_linear_time():
    keys = [PatternKey(".*a" * 60 + str(i)) for i in range(128)]
    started = time.perf_counter()
    for module in MODULES:
        assert not any(key.matches(module + ".a" * 40) for key in keys)
    assert time.perf_counter() - started < 2.0


def test_a_backtracking_pattern_cannot_hang_the_loader(tmp_path):
    """`(.|.|.|.)*Z` backtracks for hours in `re` on a module name; the loader refuses it at once. Run in a child
    process: a loader that hangs holds the GIL, and only a kill ends it."""
    path = tiny_adapter(tmp_path / "catastrophic", {"alpha_pattern": {"(.|.|.|.)*Z": 4}})
    script = textwrap.dedent(f"""
        import time
        from types import SimpleNamespace
        from engine.lora.adapter import load_adapter
        config = SimpleNamespace(**{vars(TINY)!r})
        started = time.perf_counter()
        try:
            load_adapter({path!r}, "catastrophic", config, 16)
            print("LOADED")
        except ValueError as error:
            print("REFUSED", error)
        print("SECONDS", time.perf_counter() - started)
    """)
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30,
                              cwd=Path(__file__).parents[2])
    except subprocess.TimeoutExpired:
        pytest.fail("loading an adapter whose alpha_pattern backtracks did not end within 30 s")
    assert done.returncode == 0, done.stderr
    assert "REFUSED" in done.stdout and "alpha_pattern" in done.stdout and "(.|.|.|.)*Z" in done.stdout, done.stdout
    assert float(done.stdout.split("SECONDS")[1]) < 1.0


@pytest.mark.parametrize(("config", "reason"), [
    ({"alpha_pattern": {"[": 4}}, "alpha_pattern: pattern key '\\['"),
    ({"rank_pattern": {"[": 4}}, "rank_pattern: pattern key '\\['"),
    ({"alpha_pattern": 5}, "alpha_pattern must be an object"),
    ({"rank_pattern": ["q_proj"]}, "rank_pattern must be an object"),
    ({"alpha_pattern": {"q_proj": "big"}}, "alpha_pattern\\['q_proj'\\] must be a number"),
    ({"rank_pattern": {"q_proj": 2.5}}, "rank_pattern\\['q_proj'\\] must be a positive integer"),
    ({"rank_pattern": {"q_proj": 8}}, "rank 2 but its config gives r 8"),
    ({"r": "x"}, "r must be a positive integer"),
    ({"r": 4}, "rank 2 but its config gives r 4"),
    ({"lora_alpha": "16"}, "lora_alpha must be a number"),
    ({"lora_alpha": float("inf")}, "lora_alpha must be a number"),
    ({"target_modules": ["q_proj", 3]}, "target_modules must be"),
    ({"target_modules": ["q_proj", "lm_head"]}, "targets lm_head"),
    ({"modules_to_save": "lm_head"}, "modules_to_save must be"),
    ({"use_rslora": "yes"}, "use_rslora must be"),
])
def test_a_malformed_config_is_a_value_error_with_the_reason(tmp_path, config, reason):
    path = tiny_adapter(tmp_path / "bad", config)
    with pytest.raises(ValueError, match=f"adapter 'bad'.*{reason}"):
        load_adapter(path, "bad", TINY, 16)


@pytest.mark.parametrize("damage", ["config not json", "config a list", "weights not safetensors",
                                    "bin not a state dict", "weights a vector", "rank 0"])
def test_malformed_files_are_value_errors(tmp_path, damage):
    directory = Path(tiny_adapter(tmp_path / "bad", {}))
    weights = directory / "adapter_model.safetensors"
    if damage == "config not json":
        (directory / "adapter_config.json").write_text("{'r': 2")
    elif damage == "config a list":
        (directory / "adapter_config.json").write_text("[1, 2]")
    elif damage == "weights not safetensors":
        weights.write_bytes(b"\x00" * 64)
    elif damage == "bin not a state dict":
        weights.unlink()
        torch.save([1, 2, 3], directory / "adapter_model.bin")
    elif damage == "weights a vector":
        save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(8),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(8)}, str(weights))
    else:
        save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(0, 8),
                   "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(8, 0)}, str(weights))
    with pytest.raises(ValueError, match="adapter 'bad'"):
        load_adapter(str(directory), "bad", TINY, 16)


def test_the_first_matching_key_wins_on_the_full_module_name(tmp_path):
    """PEFT takes the first key matching `model.layers.N.self_attn.q_proj` (not `layers.N.q_proj`, not the last)."""
    path = tiny_adapter(tmp_path / "patterns", {"lora_alpha": 2, "alpha_pattern": {
        "model.layers.0.self_attn.q_proj": 6, r".*\.q_proj": 10, "^model.layers.1.self_attn.v_proj": 4, "v_proj": 8}})
    got = scales(load_adapter(path, "patterns", TINY, 16))
    assert got == {(0, "q_proj"): 3.0, (1, "q_proj"): 5.0, (0, "v_proj"): 4.0, (1, "v_proj"): 2.0}


@pytest.mark.real_model
def test_scalings_equal_peft_with_patterns(tmp_path):
    """Each module's scaling with alpha_pattern / rank_pattern in PEFT's key forms is PeftModel's own."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from engine.model_loader import resolve_model
    from tokenmill.bench.lora_adapters import make_adapters

    [source] = make_adapters(tmp_path / "made", 1, rank=4, targets=("q_proj", "v_proj", "down_proj"), seed=5)
    config = json.loads((source / "adapter_config.json").read_text())
    config["alpha_pattern"] = {"model.layers.0.self_attn.q_proj": 3, r"layers\.1\d\.self_attn\.v_proj": 20,
                               "^model.layers.2.mlp.down_proj": 1, "down_proj": 12}
    config["rank_pattern"] = {r"model.layers.[0-9]+.mlp.down_proj": 4}
    (source / "adapter_config.json").write_text(json.dumps(config))
    hf_model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2-135m"), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf_model, str(source))
    hf_config = hf_model.config
    adapter = load_adapter(source, "made", hf_config, 16)
    checked = 0
    for name, module in peft_model.base_model.model.named_modules():
        if not hasattr(module, "scaling") or "default" not in getattr(module, "lora_A", {}):
            continue
        layer, kind = int(name.split(".")[2]), name.rsplit(".", 1)[-1]
        raw_b = module.lora_B["default"].weight.detach()
        projection = {"q_proj": "qkv", "v_proj": "qkv", "down_proj": "down"}[kind]
        offset = {"q_proj": 0, "v_proj": hf_config.num_attention_heads * 64 + hf_config.num_key_value_heads * 64,
                  "down_proj": 0}[kind]
        rows = {"q_proj": 0, "v_proj": 2 * 16, "down_proj": 0}[kind]
        stacked_b = adapter.weights[(layer, projection)][1]
        effective = stacked_b[rows:rows + 4, offset:offset + raw_b.shape[0]].T
        torch.testing.assert_close(effective, raw_b * module.scaling["default"], rtol=0, atol=0)
        checked += 1
    assert checked == 3 * hf_config.num_hidden_layers
