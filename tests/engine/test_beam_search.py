"""Beam search (engine/beam_search.py): the coordinator's selection on hand-made scores, then every returned beam
equal to Hugging Face's `generate(num_beams=W, early_stopping=True)` on a tiny random model (also under preemption)
and on the real model in float32, alone and batched, with ignore_eos and length penalties; beams share KV blocks."""

import math

import pytest
import torch

from engine import LLM, BeamSearchOutput, BeamSearchParams, SamplingParams
from engine.beam_search import BeamSearchState, top_candidates
from tests.engine.references import recording
from tests.engine.test_tiny_models import save_tiny

EOS = 2


def hf_beams(hf_model, prompt: list[int], width: int, max_tokens: int, length_penalty: float = 1.0,
             ignore_eos: bool = False) -> tuple[list[list[int]], list[float]]:
    """HF's W beams (generated tokens, up to and including EOS) and their scores, best first; recorded for the
    real model (tests/engine/references.py)."""
    arguments = (prompt, width, max_tokens, length_penalty, ignore_eos)
    if (model := getattr(hf_model, "fingerprint", None)) is None:
        return computed_beams(hf_model, *arguments)
    key = {"model": model, "prompt": prompt, "width": width, "max_tokens": max_tokens,
           "length_penalty": length_penalty, "ignore_eos": ignore_eos}
    beams, scores = recording("beams").get(key, lambda: computed_beams(hf_model, *arguments))
    return beams, scores


def computed_beams(hf_model, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
                   ignore_eos: bool) -> tuple[list[list[int]], list[float]]:
    extra = {"eos_token_id": None} if ignore_eos else {}
    ids = torch.tensor([prompt])
    with torch.inference_mode():  # the mask given: else with no EOS, HF masks the prompt's <|im_end|> as padding
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width, do_sample=False,
                                early_stopping=True,
                                length_penalty=length_penalty, max_new_tokens=max_tokens,
                                num_return_sequences=width, output_scores=True, return_dict_in_generate=True,
                                **extra)
    beams = []
    for row in out.sequences[:, len(prompt):].tolist():
        if not ignore_eos and EOS in row:
            row = row[:row.index(EOS) + 1]
        beams.append(row)
    return beams, out.sequences_scores.tolist()


def generated(output: BeamSearchOutput, prompt: list[int]) -> list[list[int]]:
    assert all(s.tokens[:len(prompt)] == prompt for s in output.sequences)
    return [s.tokens[len(prompt):] for s in output.sequences]


def score(sequence, prompt_len: int, length_penalty: float) -> float:
    return sequence.cum_logprob / (len(sequence.tokens) - prompt_len) ** length_penalty


# -- the selection, on hand-made log-probabilities --------------------------------------------------------------

def step(state: BeamSearchState, beams, num_generated: int = 0):
    return state.step(beams, num_generated, lambda index: ([100 + index] * num_generated, []))


def test_top_candidates_rank_all_beams_by_cumulative_logprob():
    beams = [(-1.0, {5: -0.1, 6: -2.0}), (-0.5, {7: -0.2, 8: -0.3})]
    assert [(c.beam, c.token) for c in top_candidates(beams, 3)] == [(1, 7), (1, 8), (0, 5)]
    assert top_candidates(beams, 3)[0].cum_logprob == pytest.approx(-0.7)


def test_eos_in_the_top_w_ends_a_hypothesis_and_the_rest_go_on():
    state = BeamSearchState(BeamSearchParams(beam_width=2, max_tokens=10), frozenset({EOS}))
    selection = step(state, [(0.0, {EOS: -0.1, 5: -0.2, 6: -0.3, 7: -0.4})])
    assert [(c.beam, c.token) for c in selection.next_beams] == [(0, 5), (0, 6)] and not selection.done
    assert [(h.token_ids, h.score) for h in state.hypotheses] == [([EOS], pytest.approx(-0.1))]
    # an EOS ranked below the top W is a spare: neither a hypothesis nor a beam
    selection = step(state, [(-0.2, {8: -0.1, 9: -0.2, EOS: -0.3, 10: -0.4}), (-0.3, {11: -0.5, EOS: -2.0})], 1)
    assert [(c.beam, c.token) for c in selection.next_beams] == [(0, 8), (0, 9)]
    assert len(state.hypotheses) == 1
    # the second finished hypothesis fills the W slots: done (early_stopping=True), scored by length
    selection = step(state, [(-0.3, {EOS: -0.1, 12: -0.9}), (-0.4, {13: -0.5, 14: -0.6})], 2)
    assert selection.done and selection.next_beams == []
    assert [h.score for h in state.hypotheses] == [pytest.approx(-0.1), pytest.approx(-0.4 / 3)]
    assert state.hypotheses[1].token_ids == [100, 100, EOS]


def test_max_tokens_ends_the_top_w_candidates_with_length_penalty():
    state = BeamSearchState(BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=2.0), frozenset({EOS}))
    step(state, [(0.0, {5: -0.5, 6: -1.0, 7: -3.0, 8: -4.0})])
    selection = step(state, [(-0.5, {9: -1.5, 10: -3.0}), (-1.0, {11: -0.1, 12: -5.0})], 1)
    assert selection.done
    assert [(h.token_ids[-1], h.score, h.finish_reason.value) for h in state.hypotheses] == [
        (11, pytest.approx(-1.1 / 4), "length"), (9, pytest.approx(-2.0 / 4), "length")]


def test_ignore_eos_keeps_eos_beams_running():
    state = BeamSearchState(BeamSearchParams(beam_width=2, max_tokens=5, ignore_eos=True), frozenset({EOS}))
    selection = step(state, [(0.0, {EOS: -0.1, 5: -0.2, 6: -0.3, 7: -0.4})])
    assert [c.token for c in selection.next_beams] == [EOS, 5] and not state.hypotheses


def test_params_are_checked():
    for bad in (dict(beam_width=0, max_tokens=4), dict(beam_width=2, max_tokens=0),
                dict(beam_width=2, max_tokens=4, temperature=0.7), dict(beam_width=True, max_tokens=4)):
        with pytest.raises(ValueError):
            BeamSearchParams(**bad)


# -- a tiny random model against Hugging Face -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-beam")
    return path, save_tiny(path, tokenizer, "llama")


@pytest.mark.parametrize("config", [dict(), dict(max_num_batched_tokens=16, num_kv_blocks=20, block_size=8),
                                    dict(max_num_batched_tokens=16, num_kv_blocks=20, block_size=8,
                                         enable_prefix_caching=False)],
                         ids=["roomy", "preempting", "preempting-uncached"])
def test_tiny_model_beams_match_hf(tiny, tokenizer, config):
    """Under preemption a group is preempted whole and comes back beam by beam (the token budget admits one
    prefill chunk at a time): the coordinator holds it until all of its beams are sampled in one step again."""
    path, hf = tiny
    prompts = [tokenizer.encode(t) for t in ("Hello there", "1 2 3 4 5 6 7 8 9", "A prompt that spans some blocks")]
    llm = LLM(str(path), dtype="float32", num_threads=2, **config)
    for width, ignore_eos in ((2, False), (3, True)):
        outs = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=24, ignore_eos=ignore_eos))
        for prompt, out in zip(prompts, outs, strict=True):
            assert generated(out, prompt) == hf_beams(hf, prompt, width, 24, ignore_eos=ignore_eos)[0]
    if config:
        assert llm.engine.get_stats().num_preemptions > 0
    assert llm.engine.kv_manager.pool.usage == 0 and not llm.engine.beams.groups


# -- the real model in float32 ----------------------------------------------------------------------------------

QUESTIONS = ["What is the capital of France? Answer in one word.", "Name a primary color.", "Say hello.",
             "Is water wet? Answer yes or no."]
TEXTS = ["The capital of France is", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", num_threads=2, max_model_len=512, kv_cache_memory=64 << 20)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True) for q in QUESTIONS]
    chats = [list(c["input_ids"] if hasattr(c, "keys") else c) for c in chats]
    return chats + [tokenizer.encode(t) for t in TEXTS]


@pytest.mark.parametrize("width", [2, 4])
def test_real_model_beams_match_hf_alone_and_batched(llm, hf_model, prompts, width):
    params = BeamSearchParams(beam_width=width, max_tokens=20)
    references = [hf_beams(hf_model, p, width, 20) for p in prompts]
    batched = llm.beam_search(prompts, params)
    ended_by_eos = 0
    for prompt, out, (ref_beams, ref_scores) in zip(prompts, batched, references, strict=True):
        assert generated(out, prompt) == ref_beams
        assert [score(s, len(prompt), 1.0) for s in out.sequences] == pytest.approx(ref_scores, abs=1e-4)
        ended_by_eos += sum(s.finish_reason == "stop" for s in out.sequences)
    assert ended_by_eos > 0, "no beam ended in EOS: the prompts do not exercise hypotheses"
    for prompt, (ref_beams, _) in zip(prompts[:2], references[:2], strict=True):
        (alone,) = llm.beam_search([prompt], params)
        assert generated(alone, prompt) == ref_beams
        best = alone.sequences[0]
        assert best.text == llm.get_tokenizer().decode(ref_beams[0], skip_special_tokens=True)
        assert len(best.logprobs) == len(ref_beams[0])
        assert best.cum_logprob == pytest.approx(sum(e[t].logprob for e, t in
                                                     zip(best.logprobs, ref_beams[0], strict=True)), abs=1e-4)
    assert llm.engine.kv_manager.pool.usage == 0


@pytest.mark.parametrize(("length_penalty", "ignore_eos"), [(0.5, False), (2.0, False), (1.0, True)])
def test_real_model_length_penalty_and_ignore_eos_match_hf(llm, hf_model, prompts, length_penalty, ignore_eos):
    params = BeamSearchParams(beam_width=3, max_tokens=16, length_penalty=length_penalty, ignore_eos=ignore_eos)
    chosen = prompts[1:3] + prompts[-1:]
    for prompt, out in zip(chosen, llm.beam_search(chosen, params), strict=True):
        beams, scores = hf_beams(hf_model, prompt, 3, 16, length_penalty, ignore_eos)
        assert generated(out, prompt) == beams
        assert [score(s, len(prompt), length_penalty) for s in out.sequences] == pytest.approx(scores, abs=1e-4)
        if ignore_eos:
            assert all(len(s.tokens) - len(prompt) == 16 and s.finish_reason == "length" for s in out.sequences)


def test_beams_share_blocks_and_mix_with_sampled_requests(llm, prompts):
    """A long prompt's beams hold far fewer blocks than W separate sequences would: the prompt's blocks are shared
    (reference counts > 1) and a partial block is copied only when a beam writes to it. A greedy request decoding in
    the same steps gets its own greedy output."""
    engine = llm.engine
    kv = engine.kv_manager
    prompt = prompts[0] * 6  # about 150 tokens: several full blocks
    width = 4
    (alone,) = llm.generate([prompts[1]], SamplingParams(max_tokens=12, temperature=0))
    engine.add_request("beams", prompt, BeamSearchParams(beam_width=width, max_tokens=20))
    engine.add_request("greedy", prompts[1], SamplingParams(max_tokens=12, temperature=0))
    most_shared, used, separate = 0, [], []
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
        group = engine.beams.groups.get("beams")
        if group is not None and len(group.beams) == width:
            tables = [b.seq.block_table for b in group.beams]
            most_shared = max(most_shared, max(kv.pool.ref_counts[b] for t in tables for b in t))
            used.append(len({b for t in tables for b in t}))
            separate.append(sum(map(len, tables)))
    assert most_shared >= width
    assert max(used) < max(separate) / 2, (used, separate)
    assert outputs["greedy"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(outputs["beams"].outputs) == width and outputs["beams"].error is None
    assert kv.pool.usage == 0


def test_abort_frees_every_beam(llm, prompts):
    engine = llm.engine
    engine.add_request("aborted", prompts[2], BeamSearchParams(beam_width=4, max_tokens=30))
    for _ in range(4):
        engine.step()
    assert len(engine.beams.groups["aborted"].beams) == 4 and engine.kv_manager.pool.usage > 0
    assert engine.abort("aborted")
    assert engine.kv_manager.pool.usage == 0 and not engine.beams.groups and not engine.scheduler.running


def test_group_that_cannot_fit_fails_alone(model_dir, prompts):
    small = LLM(str(model_dir), dtype="float32", num_threads=2, max_model_len=512, num_kv_blocks=20, block_size=16)
    outs = small.generate([prompts[1]], SamplingParams(max_tokens=4, temperature=0))
    assert outs[0].error is None
    with pytest.raises(ValueError, match="KV blocks"):
        small.beam_search([prompts[1]], BeamSearchParams(beam_width=8, max_tokens=64))
    assert math.isfinite(small.beam_search([prompts[1]], BeamSearchParams(2, 4))[0].sequences[0].cum_logprob)
