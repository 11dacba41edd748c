"""Tensor parallelism on CPU (gloo): greedy float32 output of TP=N is TP=1's, token for token, with prefix
caching, chunked prefill, speculation (n-gram, draft model), structured outputs and logprobs on; a flip is allowed
only where TP=1's logits nearly tie (the all-reduce sums in another order). Each rank holds its shard only; a model
N does not divide is refused; a rank that dies takes the engine down, and no rank outlives rank 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from engine import LLM, SamplingParams
from engine.distributed.group import RankFailure
from engine.structured_outputs import StructuredOutputsParams
from tests.engine.identity import NEAR_TIE

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
FEATURES = dict(dtype="float32", num_threads=1, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=32,
                enable_prefix_caching=True, enable_chunked_prefill=True,
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "max_verify_tokens": 8})
# a flip at a near-tie is allowed (the all-reduce sums in another order); how many there were is printed


def compare_with_tp1(reference, outputs) -> tuple[list[str], int]:
    """Mismatches that are real, and flips at a near-tie of TP=1's logits (its logprobs differ by the same)."""
    failures, flips = [], 0
    for index, (ref, ours) in enumerate(zip(reference, outputs, strict=True)):
        ref_ids, our_ids = ref.outputs[0].token_ids, ours.outputs[0].token_ids
        if ref_ids == our_ids:
            continue
        pos = next((i for i, (a, b) in enumerate(zip(ref_ids, our_ids, strict=False)) if a != b), None)
        if pos is None:
            failures.append(f"prompt {index}: lengths differ ({len(our_ids)} vs TP=1 {len(ref_ids)})")
            continue
        logprobs = ref.outputs[0].logprobs[pos]
        if our_ids[pos] not in logprobs:
            failures.append(f"prompt {index}: token {pos} is {our_ids[pos]}, not among TP=1's top tokens")
            continue
        gap = logprobs[ref_ids[pos]].logprob - logprobs[our_ids[pos]].logprob
        if gap < NEAR_TIE:
            flips += 1
        else:
            failures.append(f"prompt {index}: token {pos} is {our_ids[pos]}, TP=1 {ref_ids[pos]} (gap {gap:.2e})")
    return failures, flips


def workload(tokenizer, chat: list[int]) -> tuple[list, list[SamplingParams]]:
    """Prompts sharing a prefix (cache hits), one longer than the step budget (chunked), a repetitive one (n-gram
    drafts) and a JSON-schema row."""
    shared = "A shared system prompt that every request repeats, word for word, to hit the prefix cache. " * 2
    prompts = [tokenizer.encode(shared + tail) for tail in ("Paris is", "One, two, three,", "The quick brown fox")]
    prompts.append(tokenizer.encode("1 2 3 4 5 6 7 8 9 1 2 3 4 5 6 7 8 9 1 2 3 4"))
    prompts.append(chat)
    params = [SamplingParams(max_tokens=10, temperature=0, logprobs=5)] * 4
    params.append(SamplingParams(max_tokens=12, temperature=0, logprobs=5,
                                 structured_outputs=StructuredOutputsParams(json=PERSON)))
    return prompts, params


def run_twice(llm: LLM, prompts, params) -> list:
    """The first prompt alone, then all: the others find its shared prefix cached. Speculation on every step."""
    llm.engine.spec.control.lookahead = lambda num_decoding: 3
    llm.generate(prompts[:1], params[:1])
    return llm.generate(prompts, params)


def check_same_as_tp1(label: str, tp1: LLM, tpn: LLM, prompts, params) -> list:
    reference, outputs = run_twice(tp1, prompts, params), run_twice(tpn, prompts, params)
    failures, flips = compare_with_tp1(reference, outputs)
    stats, spec = tpn.engine.get_stats(), tpn.engine.spec.stats
    print(f"{label}: {len(prompts)} prompts, {flips} flip(s) at a near-tie of TP=1's logits; "
          f"prefix-cache hits {stats.prefix_cache_hits}, drafts {spec.draft_tokens} ({spec.accepted_tokens} accepted)")
    assert not failures, "\n".join(failures)
    assert flips <= 1
    assert stats.prefix_cache_hits > 0 and spec.draft_tokens > 0
    assert max(len(p) for p in prompts) > FEATURES["max_num_batched_tokens"]  # chunked
    return outputs


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    """4 heads, 2 KV heads, SmolLM2's tokenizer and one more vocabulary row than it has: the last of 2 ranks pads
    its half of the vocabulary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-tp")
    torch.manual_seed(1)
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer) + 1, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.2, eos_token_id=2, bos_token_id=1, pad_token_id=2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_features(tiny_dir) -> dict:
    """Draft-model speculation, the model drafting for itself (whole, on rank 0): drafts on every step."""
    return {**FEATURES, "speculative_config": {"method": "draft", "model": str(tiny_dir), "num_speculative_tokens": 3,
                                               "max_verify_tokens": 8}}


@pytest.fixture(scope="module")
def tiny_tp1(tiny_dir):
    return LLM(str(tiny_dir), **tiny_features(tiny_dir))


@pytest.fixture(scope="module")
def tiny_tp2(tiny_dir):
    llm = LLM(str(tiny_dir), tensor_parallel_size=2, **tiny_features(tiny_dir))
    yield llm
    llm.engine.shutdown()


def test_tiny_model_tp2_matches_tp1(tiny_tp1, tiny_tp2):
    tokenizer = tiny_tp1.get_tokenizer()
    chat = tiny_tp1.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}])
    check_same_as_tp1("tiny TP=2", tiny_tp1, tiny_tp2, *workload(tokenizer, chat))


def test_each_rank_holds_its_shard(tiny_tp1, tiny_tp2):
    whole, shard = tiny_tp1.engine.runner, tiny_tp2.engine.runner
    layer, whole_layer = shard.model.layers[0], whole.model.layers[0]
    assert layer.qkv_proj.weight.shape[0] * 2 == whole_layer.qkv_proj.weight.shape[0]
    assert layer.o_proj.weight.shape[1] * 2 == whole_layer.o_proj.weight.shape[1]
    assert layer.gate_up_proj.weight.shape[0] * 2 == whole_layer.gate_up_proj.weight.shape[0]
    vocab = tiny_tp1.engine.runner.vocab_size
    assert vocab % 2 and shard.model.embed_tokens.weight.shape[0] == (vocab + 1) // 2
    assert shard.attention.k_caches[0].shape[0] == 1 and whole.attention.k_caches[0].shape[0] == 2  # KV heads
    assert shard.kv_plan.bytes_per_block * 2 == whole.kv_plan.bytes_per_block


def test_heads_not_divisible_are_refused(tiny_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the model's attention heads"):
        LLM(str(tiny_dir), tensor_parallel_size=3, **FEATURES)


def test_self_speculation_is_refused(tiny_tp2):
    with pytest.raises(ValueError, match="self-speculation"):
        tiny_tp2.engine.set_speculative_config({"method": "self", "num_speculative_tokens": 2})


def test_ranks_exit_when_rank_0_is_killed(tiny_dir):
    script = textwrap.dedent(f"""
        import sys, time
        from engine import LLM
        llm = LLM({str(tiny_dir)!r}, tensor_parallel_size=2, dtype="float32", num_threads=1)
        print(llm.engine.ranks.processes[0].pid, flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        pid = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        assert gone(pid), f"rank 1 (pid {pid}) outlived rank 0"
    finally:
        parent.kill()


def test_a_dead_rank_takes_the_engine_down(tiny_tp2):  # the last test of tiny_tp2
    llm = tiny_tp2
    params = SamplingParams(max_tokens=4, temperature=0)
    assert llm.generate(["Paris is"], params)[0].outputs[0].token_ids
    (rank_1,) = llm.engine.ranks.processes
    os.kill(rank_1.pid, signal.SIGKILL)
    rank_1.wait(10)
    with pytest.raises(RankFailure, match="rank 1"):
        llm.generate(["Paris is"], params)
    with pytest.raises(RankFailure):  # and stays down
        llm.generate(["Paris is"], params)


@pytest.fixture(scope="module")
def smollm_engines(model_dir):
    tp1 = LLM(str(model_dir), **FEATURES)
    tp3 = LLM(str(model_dir), tensor_parallel_size=3, **FEATURES)
    yield tp1, tp3
    tp3.engine.shutdown()


def test_tensor_parallel_shards_keep_the_python_loop(smollm_engines):
    """A shard's row-parallel projections all-reduce their partial sums, which the one-call decode layers
    (cpu_kernel.DecodeLayers) would skip: a TP rank's model runs its Python loop of layers."""
    _, tp3 = smollm_engines
    assert tp3.engine.runner.model.decode_layers is None  # test_smollm2_tp3_matches_tp1 checks its tokens


def test_smollm2_tp3_matches_tp1(smollm_engines):
    tp1, tp3 = smollm_engines
    shard = tp3.engine.runner
    assert (shard.num_heads, shard.num_kv_heads) == (3, 1)  # 9 heads and 3 KV heads over 3 ranks
    chat = tp1.apply_chat_template([{"role": "user", "content": "Describe a person as JSON with a name and age."}])
    prompts, params = workload(tp1.get_tokenizer(), chat)
    outputs = check_same_as_tp1("SmolLM2-135M TP=3", tp1, tp3, prompts, params)
    assert outputs[-1].outputs[0].text.startswith("{")  # the JSON-schema row
