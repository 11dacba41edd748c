"""The offline API on the real model: inputs, ordering, per-prompt params, stops, seeds, errors, streaming."""

import random

import pytest

from engine import LLM, LLMEngine, SamplingParams
from engine.step_types import ModelRunnerOutput

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", num_threads=2, max_model_len=512, kv_cache_memory=256 << 20)


def test_strings_and_token_ids_give_the_same_greedy_output_in_input_order(llm):
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "One, two, three,", "def fibonacci(n):"]
    by_text = llm.generate(texts, GREEDY)
    by_ids = llm.generate([tok.encode(t) for t in texts], GREEDY)
    assert [o.prompt for o in by_text] == texts
    assert [o.outputs[0].token_ids for o in by_text] == [o.outputs[0].token_ids for o in by_ids]
    assert [o.prompt_token_ids for o in by_text] == [tok.encode(t) for t in texts]
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 12 for o in by_text)
    assert by_text[0].outputs[0].text == tok.decode(by_text[0].outputs[0].token_ids, skip_special_tokens=True)


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(["Hello", "Hello"], [SamplingParams(max_tokens=3, temperature=0),
                                             SamplingParams(max_tokens=7, temperature=0)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 7]
    assert outs[1].outputs[0].token_ids[:3] == outs[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["x"], [GREEDY, GREEDY])


def test_chat_applies_the_template_and_stops_at_eos(llm):
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(max_tokens=40, temperature=0))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == 2
    assert "<|im_start|>" in llm.get_tokenizer().decode(out.prompt_token_ids)


def test_stop_strings_cut_the_text_and_report_the_stop(llm):
    prompt = "Count: 1, 2, 3, 4,"
    (full,) = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))
    assert " 6" in full.outputs[0].text
    (cut,) = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, stop=[" 6"]))
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == " 6"
    assert cut.outputs[0].text == full.outputs[0].text[:full.outputs[0].text.index(" 6")]


def test_stop_token_ids(llm):
    (full,) = llm.generate(["Count: 1, 2, 3,"], GREEDY)
    stop_at = full.outputs[0].token_ids[3]
    (cut,) = llm.generate(["Count: 1, 2, 3,"], SamplingParams(max_tokens=12, temperature=0,
                                                              stop_token_ids=[stop_at]))
    assert cut.outputs[0].token_ids == full.outputs[0].token_ids[:full.outputs[0].token_ids.index(stop_at) + 1]
    assert cut.outputs[0].stop_reason == stop_at


def test_a_fixed_seed_reproduces_the_same_text_and_other_seeds_differ(llm):
    prompts = ["Write a story about a dragon."] * 2 + ["Another prompt in the batch."]
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=7), SamplingParams(max_tokens=24, temperature=1.0,
                                                                                     seed=8),
              SamplingParams(max_tokens=24, temperature=1.0)]
    first = llm.generate(prompts, params)
    again = llm.generate(prompts[:1], params[:1])  # alone in the batch this time
    assert first[0].outputs[0].text == again[0].outputs[0].text
    assert first[0].outputs[0].token_ids != first[1].outputs[0].token_ids


def test_the_step_reads_the_runners_output_by_id_whatever_its_order(llm, monkeypatch):
    prompts = ["The capital of France is", "One, two, three,", "def fibonacci(n):"]
    params = [GREEDY, SamplingParams(max_tokens=12, temperature=1.0, seed=3, n=3),
              SamplingParams(max_tokens=12, temperature=0.8, seed=5, logprobs=2, stop=[","])]
    expected = llm.generate(prompts, params)
    execute, rng = llm.engine.runner.execute, random.Random(0)

    def shuffled_execute(plan):
        output = execute(plan)
        order = rng.sample(output.seq_ids, len(output.seq_ids))
        return ModelRunnerOutput(order, {i: output.sampled_token_ids[i] for i in order},
                                 {i: output.logprobs[i] for i in order if i in output.logprobs})

    monkeypatch.setattr(llm.engine.runner, "execute", shuffled_execute)
    shuffled = llm.generate(prompts, params)
    assert [[(c.token_ids, c.text, c.logprobs) for c in o.outputs] for o in shuffled] == \
        [[(c.token_ids, c.text, c.logprobs) for c in o.outputs] for o in expected]
    assert len({tuple(c.token_ids) for c in expected[1].outputs}) > 1 and expected[2].outputs[0].logprobs


def test_a_request_that_can_never_fit_fails_alone(llm):
    too_long = "word " * 600
    outs = llm.generate(["Hi there", too_long, "Bye"], SamplingParams(max_tokens=4, temperature=0))
    assert outs[1].error and "exceeds max_model_len (512)" in outs[1].error
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 4
    assert outs[2].error is None


def test_engine_step_abort_and_stream(llm):
    engine: LLMEngine = llm.engine
    engine.add_request("keep", "Tell me a joke.", SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    engine.add_request("drop", "Tell me a story.", SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    finished = engine.step()
    assert engine.abort("drop") and not engine.abort("drop")
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [o.request_id for o in finished] == ["keep"]
    assert engine.kv_manager.pool.num_free_blocks == engine.kv_manager.usable_blocks

    fed = []

    def requests():
        for i in range(6):
            fed.append(i)
            yield f"s{i}", f"Number {i}:", SamplingParams(max_tokens=2 + i, temperature=0)

    seen = [o.request_id for o in engine.stream(requests(), max_pending=2)]
    assert sorted(seen) == [f"s{i}" for i in range(6)] and fed == list(range(6))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add_request("x", "a", GREEDY)
        engine.add_request("x", "a", GREEDY)
    engine.abort("x")


def test_unknown_settings_and_bad_models_fail_clearly(tmp_path):
    with pytest.raises(TypeError, match="unknown engine setting"):
        LLM(gpu_speed=11)
    with pytest.raises(FileNotFoundError, match="unknown model"):
        LLM("no-such-model")
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        LLM(str(tmp_path))


def test_counters_move(llm):
    prompt = "a b c d e f g h i j k l m n o p q r s t"
    before = llm.engine.get_stats().snapshot()
    llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    after = llm.engine.get_stats().snapshot()
    assert after["generation_tokens"] - before["generation_tokens"] == 5
    assert after["prompt_tokens"] - before["prompt_tokens"] == len(llm.get_tokenizer().encode(prompt))
    assert after["num_steps"] > before["num_steps"] and after["step_time_total"] > before["step_time_total"]
    assert after["num_running"] == 0 and after["kv_cache_usage"] == 0.0


def test_dtype_auto_picks_bf16_exactly_where_the_cpu_flags_say_native_bf16():
    import torch

    from engine.model_loader import pick_dtype

    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert pick_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)
    assert pick_dtype("float32", torch.device("cpu")) == torch.float32
