"""Greedy identity with Hugging Face through the Triton backend: under Triton's interpreter on CPU, or on CUDA
(the GPU check runs this file there). Random models with a tokenizer built here, so nothing else is needed."""

from __future__ import annotations

import gc
import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; only Triton reads it
import triton  # noqa: E402, F401  (in the dev extra: a missing triton fails here, never skips)

from engine import LLM, SamplingParams  # noqa: E402
from tests.engine.identity import compare, hf_greedy  # noqa: E402
from tokenmill.bench.tiny_model import SMOLLM2_135M, TINY, save_random_model  # noqa: E402

MAX_TOKENS = 16
TEXTS = ["Hello there", "The quick brown fox jumps over the lazy dog. " * 3, "1 2 3 4 5 6 7 8 9", "Paris is",
         "A somewhat longer prompt that spans a few blocks of eight tokens each, for sure."]
CONFIGS = {  # every one forces the Triton backend, in float32
    "defaults": dict(),
    "chunked-prefill-preemption": dict(max_num_batched_tokens=8, num_kv_blocks=36, block_size=4),
    "block-size-1": dict(block_size=1, max_num_batched_tokens=24),
}


@pytest.fixture(scope="module", params=["tiny", "smollm2-shape"])
def model(request, tmp_path_factory):
    if request.param == "smollm2-shape" and not CUDA:
        pytest.skip("a 30-layer model is too slow for Triton's interpreter; runs on CUDA")
    shape = TINY if request.param == "tiny" else SMOLLM2_135M
    path = tmp_path_factory.mktemp(request.param)
    hf = save_random_model(path, shape)
    from transformers import AutoTokenizer

    prompts = [AutoTokenizer.from_pretrained(path).encode(t) for t in TEXTS]
    return path, prompts, hf_greedy(hf, prompts, MAX_TOKENS)


@pytest.fixture(autouse=True)
def release_cuda_memory():
    """Each LLM sizes its KV pool from free device memory, which blocks cached by the allocator do not count."""
    yield
    if CUDA:
        gc.collect()
        torch.cuda.empty_cache()


def run_engine(path, **config) -> LLM:
    llm = LLM(str(path), attention_backend="triton", dtype="float32", num_threads=2, max_model_len=256, **config)
    assert llm.engine.runner.attention.name == "triton"
    return llm


def assert_identical(llm: LLM, prompts, reference) -> None:
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    failures, allowances = compare([o.outputs[0].token_ids for o in outs], reference)
    assert not failures and allowances <= 1, failures


@pytest.mark.parametrize("name", list(CONFIGS))
def test_triton_greedy_matches_hf(name, model):
    path, prompts, reference = model
    llm = run_engine(path, **CONFIGS[name])
    assert_identical(llm, prompts, reference)
    if name == "chunked-prefill-preemption":
        assert llm.engine.get_stats().num_preemptions > 0
    assert llm.engine.kv_manager.pool.num_free_blocks == llm.engine.kv_manager.usable_blocks


@pytest.mark.parametrize("eager", [True, False], ids=["eager-padded", "cuda-graphs"])
def test_padded_decode_buffers_match_hf(eager, model):
    """Decode steps through the CUDA-graph runner's static, padded buffers: on CPU they run eagerly (the
    padding rows must write nothing and change nothing); on CUDA, also captured and replayed."""
    if not eager and not CUDA:
        pytest.skip("CUDA graphs need CUDA")
    from engine.cuda_graphs import DecodeGraphs

    path, prompts, reference = model
    llm = run_engine(path, max_num_seqs=3, enforce_eager=True)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs.build(runner.model, runner.attention, runner.shape, runner.config.max_num_seqs,
                                       capture=not eager)
    assert_identical(llm, prompts, reference)
    assert runner.graphs.replays > 0 and set(runner.graphs.sizes) == {1, 2, 4}
