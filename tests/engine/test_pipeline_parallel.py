"""Pipeline parallelism on CPU (gloo): the layers split into stages, one process each, a step's sequences in
micro-batches. Float32 output of PP=N is PP=1's token for token (greedy and seeded sampling with n > 1, under
chunked prefill, prefix caching and preemption), on tiny random models (both layer-op paths, 2 and 3 stages,
uneven splits, an untied LM head) and on the bundled SmolLM2-135M split 15/15; with tensor parallelism inside each
stage too, but for a flip at a near-tie. Each stage holds only its layers and their KV; unsupported combinations
are refused; a stage that dies takes the engine down with a clear error, between steps or in the middle of one."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from engine import LLM, SamplingParams
from engine.batch import BatchItem, build_step_batch
from engine.config import EngineConfig
from engine.distributed.group import RankFailure
from engine.distributed.pipeline import micro_batches, split_items, stage_layers
from engine.step_types import SeqBlocks, StepInput

FEATURES = dict(dtype="float32", num_threads=1, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=32,
                enable_prefix_caching=True, enable_chunked_prefill=True)


def test_stage_layers_split_evenly_later_stages_take_the_rest():
    assert stage_layers(30, 2) == [range(0, 15), range(15, 30)]
    assert [len(r) for r in stage_layers(30, 4)] == [7, 7, 8, 8]
    assert stage_layers(5, 2) == [range(0, 2), range(2, 5)]
    assert stage_layers(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    with pytest.raises(ValueError, match="pipeline_parallel_size 4 exceeds the model's 3 layers"):
        stage_layers(3, 4)


def item(seq_id: int, start: int, count: int) -> BatchItem:
    return BatchItem(SeqBlocks(seq_id, list(range(1 + 8 * seq_id, 9 + 8 * seq_id))), start, [0] * count)


def test_micro_batches_keep_every_logits_row():
    """Whole sequences in each micro-batch, about equal tokens; each logits row of the step (a forked row twice,
    every row of a sequence with drafts) is found at its own sequence and offset among the micro-batches' rows."""
    items = [item(0, 20, 1), item(1, 0, 10), item(2, 5, 1), item(3, 0, 6), item(4, 40, 1)]
    whole = build_step_batch(items, 16, lambda values: values)[1]
    sample_rows = [whole[0].first, whole[1].last, whole[2].first, whole[2].first, *range(whole[3].first, whole[3].last
                                                                                          + 1), whole[4].first]
    owner = {r.first + k: (seq_id, k) for seq_id, r in whole.items() for k in range(r.count)}
    for rows_in_order, reordered in ((sample_rows, False), (sample_rows[::-1], True)):  # step order, and not
        parts, order = micro_batches(StepInput([], items, rows_in_order), 2, 16)
        assert [[i.seq.seq_id for i in p.items] for p in parts] == [[0, 1], [2, 3, 4]]
        assert (order is not None) == reordered
        placed = []
        for part in parts:
            rows = build_step_batch(part.items, 16, lambda values: values)[1]
            part_owner = {r.first + k: (seq_id, k) for seq_id, r in rows.items() for k in range(r.count)}
            placed += [part_owner[row] for row in part.sample_rows]
        order = order or range(len(placed))
        assert [placed[i] for i in order] == [owner[row] for row in rows_in_order]
    assert micro_batches(StepInput([], items, sample_rows), 1, 16) == ([(items, sample_rows)], None)
    assert [len(p) for p in split_items([item(i, 0, n) for i, n in enumerate([1] * 7 + [25])], 2)] == [7, 1]
    assert len(split_items([item(0, 0, 30)], 4)) == 1  # never more parts than sequences


@pytest.mark.parametrize(("settings", "message"), [
    (dict(enable_lora=True), "enable_lora does not combine with pipeline_parallel_size > 1"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8' does not combine with pipeline_parallel_size > 1"),
    (dict(speculative_config={"method": "self", "num_speculative_tokens": 2}), "method 'self' does not combine"),
    (dict(pipeline_micro_batches=0), "pipeline_micro_batches must be >= 1"),
])
def test_unsupported_combinations_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(pipeline_parallel_size=2, **settings)


def test_pipeline_size_must_be_positive():
    with pytest.raises(ValueError, match="pipeline_parallel_size must be >= 1"):
        EngineConfig(pipeline_parallel_size=0)


def workload(tokenizer) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts of different lengths (some longer than the step budget: chunked; two sharing a prefix: cache hits),
    greedy, and seeded sampling with n = 2 (the sampler on rank 0 sees the same logits, bit for bit)."""
    shared = "A shared system prompt that every request repeats, word for word, to hit the prefix cache. "
    texts = ["Paris is", shared + "One, two, three,", shared + "The quick brown fox", "1 2 3 4 5 6 7 8 9 1 2 3 4",
             "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
             "movable metal type, oil-based ink and a wooden screw press into a system. Summarize it.",
             "Hello"]
    prompts = [tokenizer.encode(text) for text in texts]
    params = [SamplingParams(max_tokens=12, temperature=0)] * (len(prompts) - 1)
    params.append(SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=2, ignore_eos=True))
    return prompts, params


def tokens(outputs) -> list[list[list[int]]]:
    return [[sample.token_ids for sample in output.outputs] for output in outputs]


def check_same_as_pp1(label: str, pp1: LLM, ppn: LLM, prompts, params) -> None:
    reference, outputs = pp1.generate(prompts, params), ppn.generate(prompts, params)
    stats, runner = ppn.engine.get_stats(), ppn.engine.runner
    print(f"{label}: {len(prompts)} prompts, {stats.num_steps} steps, {runner.split_steps} split into micro-batches, "
          f"{stats.num_preemptions} preemptions, prefix-cache hits {stats.prefix_cache_hits}")
    assert tokens(outputs) == tokens(reference)
    assert max(len(p) for p in prompts) > FEATURES["max_num_batched_tokens"]  # chunked
    assert runner.split_steps > 0 and stats.prefix_cache_hits > 0
    assert len(outputs[-1].outputs) == 2 and all(len(o.token_ids) == 12 for o in outputs[-1].outputs)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    """5 layers (split 2/3, or 1/2/2), an LM head of its own: rank 0 loads it beside the embedding."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("tiny-pp")
    torch.manual_seed(2)
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False, initializer_range=0.2, eos_token_id=2, bos_token_id=1, pad_token_id=2)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


TINY = {**FEATURES, "num_kv_blocks": 10}  # few blocks: preemption


@pytest.mark.parametrize(("stages", "layer_ops", "preemption", "speculation"), [
    (2, "torch", "swap", None), (3, "fused", "recompute", "draft")])  # fused layer ops and recompute: with 3 stages
def test_tiny_model_ppn_matches_pp1(tiny_dir, tokenizer, monkeypatch, stages, layer_ops, preemption, speculation):
    """Speculation's verify rows (several logits rows per sequence) come back from the last stage too: the model
    drafts for itself (whole, on rank 0)."""
    monkeypatch.setenv("TOKENMILL_CPU_LAYER_OPS", "1" if layer_ops == "fused" else "0")  # the stages inherit it
    if speculation:
        speculation = {"method": "draft", "model": str(tiny_dir), "num_speculative_tokens": 3, "max_verify_tokens": 8}
    settings = {**TINY, "preemption_mode": preemption, "speculative_config": speculation}
    pp1 = LLM(str(tiny_dir), **settings)
    ppn = LLM(str(tiny_dir), pipeline_parallel_size=stages, **settings)
    try:
        if speculation:  # drafts on every step
            for llm in (pp1, ppn):
                llm.engine.spec.control.lookahead = lambda num_decoding: 3
        check_same_as_pp1(f"tiny PP={stages} {layer_ops} {preemption}", pp1, ppn, *workload(tokenizer))
        assert not speculation or ppn.engine.spec.stats.draft_tokens > 0
        stats = ppn.engine.get_stats()
        assert speculation or stats.num_preemptions > 0  # drafts' verify steps leave the pool room enough
        if preemption == "swap":
            assert stats.kv_blocks_swapped_out > 0
        runner = ppn.engine.runner
        assert len(runner.model.layers) == runner.num_layers == len(stage_layers(5, stages)[0])
        assert len(runner.attention.k_caches) == runner.num_layers  # KV for its own layers only
        assert runner.model.lm_head is not None and runner.model.embed_tokens is not None
    finally:
        ppn.engine.shutdown()


def test_tiny_model_tp2_pp2_matches_pp1(tiny_dir, tokenizer):
    """4 ranks: 2 stages of 2 tensor-parallel ranks each (each stage's rank t trades with rank t of the next; the
    first stage's ranks gather their vocabulary columns of the logits). A flip is allowed only where PP=1's logits
    nearly tie, as for tensor parallelism alone (its all-reduce sums in another order)."""
    from tests.engine.test_tensor_parallel import compare_with_tp1

    prompts, _ = workload(tokenizer)
    params = [SamplingParams(max_tokens=12, temperature=0, logprobs=5)] * len(prompts)
    pp1 = LLM(str(tiny_dir), **TINY)
    both = LLM(str(tiny_dir), tensor_parallel_size=2, pipeline_parallel_size=2, **TINY)
    try:
        runner = both.engine.runner
        assert len(both.engine.ranks.processes) == 3 and runner.tp.shard.world_size == 2
        assert (runner.num_layers, runner.num_kv_heads, runner.num_heads) == (2, 1, 2)  # 2 of 5 layers, half the heads
        failures, flips = compare_with_tp1(pp1.generate(prompts, params), both.generate(prompts, params))
        print(f"tiny TP=2 x PP=2: {flips} flip(s) at a near-tie of PP=1's logits")
        assert not failures, "\n".join(failures)
        assert flips <= 1 and runner.split_steps > 0
    finally:
        both.engine.shutdown()


def test_more_stages_than_layers_are_refused(tiny_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size 6 exceeds the model's 5 layers"):
        LLM(str(tiny_dir), pipeline_parallel_size=6, **FEATURES)


def test_a_dead_stage_takes_the_engine_down(tiny_dir):
    llm = LLM(str(tiny_dir), pipeline_parallel_size=2, **FEATURES)
    try:
        params = SamplingParams(max_tokens=4, temperature=0)
        assert llm.generate(["Paris is"], params)[0].outputs[0].token_ids
        (stage_1,) = llm.engine.ranks.processes
        os.kill(stage_1.pid, signal.SIGKILL)
        stage_1.wait(10)
        with pytest.raises(RankFailure, match="pipeline-parallel rank 1"):
            llm.generate(["Paris is"], params)
        with pytest.raises(RankFailure):  # and stays down
            llm.generate(["Paris is"], params)
    finally:
        llm.engine.shutdown()


def test_a_stage_dying_mid_generation_raises_instead_of_hanging(tiny_dir):
    llm = LLM(str(tiny_dir), pipeline_parallel_size=3, **FEATURES)
    try:
        params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        failure: list[BaseException] = []

        def generate() -> None:
            try:
                llm.generate(["Paris is", "One, two, three,", "The quick brown fox"], params)
            except BaseException as error:  # handed to the test's thread
                failure.append(error)

        thread = threading.Thread(target=generate)
        thread.start()
        deadline = time.monotonic() + 60
        while llm.engine.stats.num_steps < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(llm.engine.ranks.processes[0].pid, signal.SIGKILL)  # the middle stage (rank 1)
        thread.join(60)
        assert not thread.is_alive(), "generate hung after a stage died"
        print(f"after the kill: {failure[0] if failure else None!r}")
        assert failure and isinstance(failure[0], RankFailure), failure
        assert all(process.poll() is not None for process in llm.engine.ranks.processes)  # the others are stopped
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def smollm_engines(model_dir):
    settings = {**FEATURES, "num_kv_blocks": 10}  # preemption
    pp1 = LLM(str(model_dir), **settings)
    pp2 = LLM(str(model_dir), pipeline_parallel_size=2, **settings)
    yield pp1, pp2
    pp2.engine.shutdown()


def test_smollm2_pp2_matches_pp1(smollm_engines):
    pp1, pp2 = smollm_engines
    runner = pp2.engine.runner
    assert runner.layer_range == range(0, 15) and runner.num_layers == 15  # 30 layers split 15/15
    assert runner.kv_plan.bytes_per_block * 2 == pp1.engine.runner.kv_plan.bytes_per_block
    check_same_as_pp1("SmolLM2-135M PP=2", pp1, pp2, *workload(pp1.get_tokenizer()))
    assert pp2.engine.get_stats().num_preemptions > 0


def test_cli_flag_reaches_the_engine_settings():
    import argparse

    from tokenmill.options import add_engine_options, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_options(parser, lora="single-rank")  # the worker's: LoRA on unless the model spans ranks
    assert "pipeline_parallel_size" not in engine_kwargs(parser.parse_args([]))  # the engine as without the flag
    given = engine_kwargs(parser.parse_args(["--pipeline-parallel-size", "2"]))
    assert given["pipeline_parallel_size"] == 2 and "enable_lora" not in given
    assert EngineConfig.from_kwargs(**given).pipeline_parallel_size == 2
    assert engine_kwargs(parser.parse_args(["-pp", "3", "-tp", "2"]))["pipeline_parallel_size"] == 3
