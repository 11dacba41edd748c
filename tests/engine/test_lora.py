"""Multi-LoRA on the real model: a batch mixing adapters and the base model gives each request its adapter's greedy
tokens as Hugging Face + PEFT with the adapter merged (float32), with prefix caching on and fewer device slots than
adapters; the prefix cache keys an adapter on its weights, not its name."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, LoRARequest, SamplingParams
from engine.block_pool import first_block_key
from engine.sequence import Sequence
from tests.engine.lora_reference import hf_peft_greedy
from tokenmill.bench.lora_adapters import make_adapters

SYSTEM = ("You are a careful assistant for a public library. Answer in one short paragraph, cite the shelf "
          "number when you know it, and never invent a book that is not in the catalogue.")
QUESTIONS = ["Where are the atlases?", "Can I renew a loan online?", "What is a haiku?", "Who wrote Dracula?",
             "How do I print a page?", "Name a bird that cannot fly."]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    full = make_adapters(root / "full", 2, rank=8, seed=11)
    qv = make_adapters(root / "qv", 1, rank=4, targets=("q_proj", "v_proj"), seed=12)
    return {"full-a": full[0], "full-b": full[1], "qv": qv[0]}


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, enable_prefix_caching=True)


def chat(llm, question: str) -> list[int]:
    return llm.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


@pytest.mark.real_model
def test_a_batch_mixing_adapters_and_the_base_model_equals_hf_peft_merged(llm, adapters):
    names = [None, "full-a", "full-b", "qv"]
    requests = {name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items())}
    prompts = [chat(llm, q) for q in QUESTIONS]
    rows = [(prompt, names[(i + j) % len(names)]) for i, prompt in enumerate(prompts) for j in range(2)]
    activations = llm.engine.runner.lora.num_activations
    outputs = llm.generate([p for p, _ in rows], greedy(),
                           lora_request=[requests.get(name) for _, name in rows])
    assert llm.engine.runner.lora.num_activations - activations >= 3  # 3 adapters through 2 slots
    got = {name: {} for name in names}
    for (prompt, name), output in zip(rows, outputs, strict=True):
        got[name][tuple(prompt)] = list(output.outputs[0].token_ids)
    base = {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(prompts, llm.generate(prompts, greedy()),
                                                                  strict=True)}
    for name in names:
        asked = [list(p) for p in got[name]]
        expected = hf_peft_greedy(None if name is None else adapters[name], asked, MAX_TOKENS)
        assert [got[name][tuple(p)] for p in asked] == expected, name
        if name is not None:  # the adapter changes the text, else the comparison would prove nothing
            assert any(got[name][p] != base[p] for p in got[name]), name


@pytest.mark.real_model
def test_the_cache_keys_an_adapter_on_its_weights_not_its_name(llm, adapters, tmp_path):
    archive = ("You index maps for a city archive. Answer with the floor, the cabinet and the drawer, and say "
               "whether the map may leave the reading room.")
    prompt = llm.apply_chat_template([{"role": "system", "content": archive},
                                      {"role": "user", "content": "Which floor holds the maps?"}])
    assert len(prompt) >= 3 * llm.engine.config.block_size

    def run(lora: LoRARequest | None) -> tuple[list[int], int]:
        output = llm.generate([prompt], greedy(), lora_request=lora)[0]
        return list(output.outputs[0].token_ids), output.num_cached_tokens

    run(None)  # the base model's blocks are in the cache now
    first, cached = run(LoRARequest("support-v1", 11, str(adapters["full-a"])))
    assert cached == 0  # an adapter never reads the base model's blocks
    again, cached = run(LoRARequest("support-alias", 12, str(adapters["full-a"])))
    assert cached > 0 and again == first  # the same adapter under another name shares its blocks
    _, cached = run(LoRARequest("other", 13, str(adapters["full-b"])))
    assert cached == 0  # two adapters never share
    reused = tmp_path / "support"
    shutil.copytree(adapters["full-a"], reused)
    run(LoRARequest("support-v1", 11, str(reused)))
    shutil.rmtree(reused)
    shutil.copytree(adapters["qv"], reused)  # a new adapter under the old name, id and path
    tokens, cached = run(LoRARequest("support-v1", 11, str(reused)))
    assert cached == 0  # the old weights' blocks are not reused
    assert tokens == hf_peft_greedy(adapters["qv"], [prompt], MAX_TOKENS)[0]


@pytest.mark.real_model
def test_adapters_the_engine_cannot_serve_are_refused_with_the_reason(llm, adapters, tmp_path):
    def broken(change) -> str:
        target = tmp_path / f"adapter-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(adapters["qv"], target)
        config = json.loads((target / "adapter_config.json").read_text())
        change(config)
        (target / "adapter_config.json").write_text(json.dumps(config))
        return str(target)

    cases = {
        "lm_head": broken(lambda c: c.update(modules_to_save=["lm_head"])),
        "DoRA": broken(lambda c: c.update(use_dora=True)),
        "embed_tokens": broken(lambda c: c.update(target_modules=["q_proj", "embed_tokens"])),
    }
    big = make_adapters(tmp_path / "big", 1, rank=16, targets=("q_proj",), seed=3)[0]
    cases["max_lora_rank"] = str(big)
    cases["adapter_config.json"] = str(tmp_path / "missing")
    for i, (reason, path) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=reason):
            llm.generate(["hello"], greedy(2), lora_request=LoRARequest(f"bad{i}", 90 + i, path))
    assert not llm.engine.has_unfinished_requests()


def test_a_salt_cannot_spell_an_adapters_cache_key():
    class Adapter:
        digest = "ab" * 32

    with_adapter = Sequence(0, "a", [1, 2], None, cache_salt=None, lora=Adapter())
    forged = Sequence(1, "b", [1, 2], None, cache_salt=first_block_key(with_adapter))
    salted_adapter = Sequence(2, "c", [1, 2], None, cache_salt="t", lora=Adapter())
    assert len({first_block_key(with_adapter), first_block_key(forged), first_block_key(salted_adapter),
                first_block_key(Sequence(3, "d", [1, 2], None))}) == 4


def test_lora_needs_enable_lora_and_refuses_tensor_parallelism():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("x", 0, "/tmp")


@pytest.mark.real_model
def test_speculative_decoding_with_adapters_keeps_each_adapters_tokens(llm, adapters):
    """Self-drafting runs the model's first layers without adapters; the target pass verifies with each row's."""
    prompts = [chat(llm, q) for q in QUESTIONS[:4]]
    loras = [None, *(LoRARequest(name, i + 1, str(path)) for i, (name, path) in enumerate(adapters.items()))]
    params = greedy(16)
    expected = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, lora_request=loras)]
    speculating = LLM(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, speculative_config={
        "method": "self", "num_speculative_tokens": 3, "draft_layers": 8, "min_acceptance": 0.0})
    got = [list(o.outputs[0].token_ids) for o in speculating.generate(prompts, params, lora_request=loras)]
    assert got == expected
    assert speculating.engine.spec.stats.draft_tokens > 0
