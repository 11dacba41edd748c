"""Fast checks on tiny random models: greedy identity with HF for Llama, Qwen2 and Qwen3 layouts,
under chunked prefill and preemption, through the fused CPU layer ops and through plain torch ops."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.identity import compare, hf_greedy


def save_tiny(path, tokenizer, model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1)
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        tie_word_embeddings=model_type != "qwen2", initializer_range=0.2, eos_token_id=2, bos_token_id=1,
        pad_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def prompts(tokenizer):
    texts = ["Hello there", "The quick brown fox jumps over the lazy dog. " * 6, "1 2 3 4 5 6 7 8 9",
             "Paris is", "A somewhat longer prompt that spans a few blocks of sixteen tokens each, for sure."]
    return [tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize(("model_type", "layer_ops"), [("llama", "fused"), ("llama", "torch"), ("qwen2", "fused"),
                                                      ("qwen2", "torch"), ("qwen3", "torch")])  # qwen3 never fuses
def test_tiny_model_greedy_matches_hf(model_type, layer_ops, tmp_path, tokenizer, prompts, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_LAYER_OPS", "1" if layer_ops == "fused" else "0")
    hf = save_tiny(tmp_path, tokenizer, model_type)
    reference = hf_greedy(hf, prompts, 20)
    for config in (dict(), dict(max_num_batched_tokens=8, num_kv_blocks=12, block_size=8)):
        llm = LLM(str(tmp_path), dtype="float32", num_threads=2, **config)
        fused = llm.engine.runner.model.fused_ops is not None
        assert fused == (layer_ops == "fused" and model_type != "qwen3"), "qwen3's q/k norms run in torch"
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0))
        failures, allowances = compare([o.outputs[0].token_ids for o in outs], reference)
        assert not failures and allowances <= 1, (config, failures)
        if "num_kv_blocks" in config:
            assert llm.engine.get_stats().num_preemptions > 0


def test_one_long_prompt_among_cached_short_ones_prefills_in_runs(tmp_path, tokenizer, monkeypatch):
    """Prompts sharing a long prefix sent together: the first computes it, the rest hit the cache in the same
    step with a few tokens each; the short ones attend in their own run (no padding to the long one), with
    HF's greedy output."""
    import engine.attention.torch_backend as tb

    hf = save_tiny(tmp_path, tokenizer, "llama")
    prefix = tokenizer.encode("A shared system prompt that every request repeats word for word. " * 6)
    prompts = [prefix + tokenizer.encode(f" Question {i}: what comes next?") for i in range(6)]
    runs, real = [], tb.prefill_runs

    def recording(*args, **kwargs):
        runs.append(real(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(tb, "prefill_runs", recording)
    llm = LLM(str(tmp_path), dtype="float32", num_threads=2, enable_prefix_caching=True, block_size=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    failures, allowances = compare([o.outputs[0].token_ids for o in outs], hf_greedy(hf, prompts, 12))
    assert not failures and allowances <= 1, failures
    assert any(len(r) > 1 for r in runs), f"no step split its prefills: {runs}"
    assert real([100, 5, 6, 5], [100, 105, 106, 105]) == [(0, 1), (1, 4)]
    assert real([50, 50], [50, 50]) == [(0, 2)]


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_config_and_tokenizer_read_without_the_auto_classes_match_them(model_type, tmp_path, tokenizer, model_dir):
    """engine/hf_files.py reads transformers-written files through the base classes: every field the Auto
    classes give is there with the same value, and the tokenizer encodes and templates the same."""
    from transformers import AutoConfig, AutoTokenizer

    from engine.hf_files import load_config, load_tokenizer

    save_tiny(tmp_path, tokenizer, model_type)
    for directory in (tmp_path, model_dir):
        full, light = AutoConfig.from_pretrained(directory), load_config(directory)
        assert type(light).__name__ == "PreTrainedConfig"  # the light path was taken
        fields = {key: value for key, value in vars(full).items()
                  if not key.startswith("_") and key != "use_cache"}  # use_cache: HF's generate() flag only
        assert len(fields) > 20 and {key: getattr(light, key, "missing") for key in fields} == fields
        auto, light_tokenizer = AutoTokenizer.from_pretrained(directory), load_tokenizer(directory)
        chat = [{"role": "user", "content": "Hi <|im_end|> there"}]
        assert light_tokenizer("a b\nc <|im_start|>")["input_ids"] == auto("a b\nc <|im_start|>")["input_ids"]
        assert light_tokenizer.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat,
                                                                                                      tokenize=False)
        assert (light_tokenizer.eos_token_id, len(light_tokenizer)) == (auto.eos_token_id, len(auto))
