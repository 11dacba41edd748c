"""The bundled Gemma 3 270M: greedy float32 output is Hugging Face's own `Gemma3ForCausalLM`'s on the same dequantized
weights, token for token (teacher-forced verdicts, tests/engine/identity.py, recorded in
references/gemma3_greedy_verdicts.json), on 24 chat and plain prompts, two of them longer than the 512-token sliding
window: alone, in a batch, again from the prefix cache, with n-gram speculation, and in prefill chunks of 64 tokens
beside running decodes."""

from __future__ import annotations

import datetime
import json
import random

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.identity import PASSAGE, HFVerdict, teacher_forced_verdict
from tests.engine.references import DIR, LazyModel

MAX_TOKENS = 16
RECORDED_IN = "gemma3_greedy_verdicts"
# drafts at every step: the adaptive control, timing a busy machine, may find no k that pays and draft nothing
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "max_verify_tokens": 64, "probe_every": 1}
PLAIN = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "Water boils at 100 degrees Celsius at sea level because",
    "1, 2, 3, 5, 8, 13, 21,",
    "The three primary colors are",
    "Translate to French: 'Good morning, how are you?' ->",
    "A list of the planets of the solar system: Mercury,",
]
OTHER_PASSAGE = (
    "Rivers shape the land they cross. Over thousands of years a river cuts valleys, carries sand and stones toward "
    "the sea and drops them where its current slows, building deltas, islands and fertile plains. Cities grew beside "
    "rivers because they gave water, food, a road for boats and a border that was easy to defend. "
)


@pytest.fixture(scope="session")
def gemma_dir():
    from engine.model_loader import resolve_model

    return resolve_model("gemma3-270m")


@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_dir):
    from engine.hf_files import load_tokenizer

    return load_tokenizer(gemma_dir)


@pytest.fixture(scope="module")  # 1.1 GB once loaded, only to compute a verdict not recorded yet
def hf_gemma(gemma_dir):
    from transformers import AutoModelForCausalLM

    return LazyModel(gemma_dir, lambda: AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def prompts(gemma_tokenizer):
    from engine.chat import chat_token_ids
    from tokenmill.bench.workload import questions

    chats = [chat_token_ids(gemma_tokenizer, [{"role": "user", "content": q}]) for q in questions()[:13]]
    chats.append(chat_token_ids(gemma_tokenizer, [{"role": "system", "content": "Answer in one short sentence."},
                                                  {"role": "user", "content": "Why is the sky blue?"}]))
    plain = [gemma_tokenizer(text).input_ids for text in PLAIN]
    long_chat = chat_token_ids(gemma_tokenizer, [{"role": "user", "content": PASSAGE * 7
                                                  + "Summarize the passage above in one sentence."}])
    long_plain = gemma_tokenizer(OTHER_PASSAGE * 9 + "In short, rivers").input_ids
    return chats + plain + [long_chat, long_plain]


@pytest.fixture(scope="module")
def reference(hf_gemma):
    return HFVerdict(hf_gemma, MAX_TOKENS, RECORDED_IN)


def check(llm, prompts, reference, outputs, label: str) -> None:
    failures, allowances = reference.compare(prompts, [o.outputs[0].token_ids for o in outputs])
    print(f"{label}: {len(prompts)} prompts, {allowances} needed the near-tie allowance")
    assert not failures, f"{label}:\n" + "\n".join(failures)
    assert allowances <= 2


def test_the_converted_model_is_gemma3_with_sliding_windows(gemma_dir, gemma_tokenizer, prompts):
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == 512
    assert config["layer_types"].count("full_attention") == 3 and config["vocab_size"] == 262144
    generation = json.loads((gemma_dir / "generation_config.json").read_text())
    end_of_turn = gemma_tokenizer.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn in generation["eos_token_id"]  # a chat turn ends there, as the -it model's files say
    rendered = gemma_tokenizer.decode(prompts[0])
    assert rendered.startswith("<bos><start_of_turn>user\n")
    assert rendered.endswith("<end_of_turn>\n<start_of_turn>model\n")
    assert len(prompts) == 24 and sorted(map(len, prompts))[-2] > 550  # two prompts past the window (512)


def test_greedy_matches_hugging_face_alone_batched_cached_and_speculated(gemma_dir, prompts, reference):
    """One engine: four prompts one at a time (the long ones among them), then all 24 in one batch, then all again
    (their blocks now in the prefix cache), then eight with n-gram speculation (few enough to verify drafts)."""
    llm = LLM(str(gemma_dir), dtype="float32", num_threads=2)
    assert llm.engine.runner.attention.layer_windows.count(512) == 15
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    alone = prompts[:1] + prompts[18:19] + prompts[-2:]
    check(llm, alone, reference, [llm.generate([p], params)[0] for p in alone], "alone")
    check(llm, prompts, reference, llm.generate(prompts, params), "batch")
    cached = llm.generate(prompts, params)
    assert sum(o.num_cached_tokens for o in cached) > 0.8 * sum(map(len, prompts))
    check(llm, prompts, reference, cached, "prefix cache")
    llm.engine.set_speculative_config(NGRAM)
    speculated = prompts[14:20] + prompts[-2:]  # plain prompts (a number series, code) and the long ones repeat
    check(llm, speculated, reference, llm.generate(speculated, params), "ngram speculation")
    stats = llm.engine.get_stats()
    print(f"ngram: {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} drafts accepted")
    assert stats.spec_accepted_tokens > 0
    assert llm.engine.kv_manager.pool.num_free_blocks == llm.engine.kv_manager.usable_blocks


def test_greedy_matches_hugging_face_in_prefill_chunks(gemma_dir, prompts, reference):
    """Chunks of 64 tokens beside running decodes: a long prompt's local layers read windows that begin in blocks of
    earlier chunks."""
    llm = LLM(str(gemma_dir), dtype="float32", num_threads=2, max_num_batched_tokens=64, enable_prefix_caching=False)
    picked = prompts[::4] + prompts[-2:]
    check(llm, picked, reference, llm.generate(picked, SamplingParams(max_tokens=MAX_TOKENS, temperature=0)),
          "chunked prefill")


def test_recorded_verdicts_are_what_hf_says(hf_gemma):
    """Two recorded verdicts, picked anew each day, computed again (as tests/engine/test_references.py does for
    SmolLM2's)."""
    recorded = json.loads((DIR / f"{RECORDED_IN}.json").read_text())
    entries = list(recorded["entries"].values())
    assert len(entries) >= 24 and any(entry["value"] is None for entry in entries)
    for entry in random.Random(datetime.date.today().toordinal()).sample(entries, 2):
        key = entry["key"]
        assert key["model"] == hf_gemma.fingerprint
        assert teacher_forced_verdict(hf_gemma, key["prompt"], key["output"]) == entry["value"], key


def test_an_unsupported_architecture_fails_at_once_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
                                                      "transformers_version": "5.25.0"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"unsupported model: model_type 'gpt2'.*GPT2LMHeadModel.*supported: .*llama.*"
                                         r"gemma3_text"):
        LLM(str(tmp_path))


def save_tiny_gemma(path, tokenizer, **overrides):
    """A random 4-layer Gemma 3 (three local layers with a window of 8 tokens, one global), as transformers makes it."""
    from transformers import AutoModelForCausalLM, Gemma3TextConfig

    torch.manual_seed(2)
    settings = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                    sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                    query_pre_attn_scalar=32, initializer_range=0.2, eos_token_id=2, bos_token_id=1, pad_token_id=2)
    config = Gemma3TextConfig(**{**settings, **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # Gemma's norms start at 0, i.e. a scale of 1: give them some of their own
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(0, 0.3)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


TINY_CONFIGS = {
    "defaults": dict(),
    "chunks-and-preemption": dict(max_num_batched_tokens=8, num_kv_blocks=14, block_size=8),
    "ngram": dict(speculative_config={**NGRAM, "max_verify_tokens": 128}),
}


@pytest.mark.parametrize("variant", ["gemma3-270m-like", "scaled-queries-softcapped"])
def test_tiny_gemma3_with_a_window_of_8_matches_hf(variant, tmp_path, tokenizer):
    """A window of 8 tokens, so every prompt outgrows it: greedy identity with HF's `Gemma3ForCausalLM`, in a batch,
    in 8-token prefill chunks with preemption, and with n-gram speculation; the second variant scales queries by
    query_pre_attn_scalar 24 (not head_dim 32) and soft-caps the final logits at 5."""
    from tests.engine.identity import compare, hf_greedy

    overrides = {} if variant == "gemma3-270m-like" else dict(query_pre_attn_scalar=24, final_logit_softcapping=5.0)
    hf = save_tiny_gemma(tmp_path, tokenizer, **overrides)
    texts = ["Hello there", "The quick brown fox jumps over the lazy dog. " * 5, "1 2 3 4 5 6 7 8 9 10 11 12",
             "Paris is", "A somewhat longer prompt that spans a few blocks of eight tokens each, for sure."]
    prompts = [tokenizer.encode(t) for t in texts]
    reference = hf_greedy(hf, prompts, 16)
    for name, config in TINY_CONFIGS.items():
        llm = LLM(str(tmp_path), dtype="float32", num_threads=2, **config)
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
        failures, allowances = compare([o.outputs[0].token_ids for o in outs], reference)
        assert not failures and allowances <= 1, (name, failures)
        if "num_kv_blocks" in config:
            assert llm.engine.get_stats().num_preemptions > 0
