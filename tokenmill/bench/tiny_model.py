"""Random-weight Llama checkpoints with a tokenizer trained here, offline: tiny ones for tests, and one of
SmolLM2-135M's shape for benchmarks where the bundled weights are not installed (the GPU machine).

Throughput does not depend on the weights' values when outputs are forced to fixed lengths, so a random
model of the real shape benchmarks like the real one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2, as in SmolLM2
CHAT_TEMPLATE = (  # SmolLM2-135M-Instruct's
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int | None  # None: the tokenizer's
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0


TINY = ModelShape(64, 96, 2, 4, 2, 16, None, 512)
SMOLLM2_135M = ModelShape(576, 1536, 30, 9, 3, 64, 49152, 8192, 100000.0)


def build_tokenizer(vocab_size: int = 1024):
    """Byte-level BPE trained on the benchmark questions, with SmolLM2's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tokenmill.bench.workload import questions

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(questions() + [CHAT_TEMPLATE], trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=SPECIAL_TOKENS[0],
                                      bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2],
                                      pad_token=SPECIAL_TOKENS[2])
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def save_random_model(path: str | Path, shape: ModelShape = TINY, model_type: str = "llama", seed: int = 1,
                      initializer_range: float = 0.2):
    """Write a float32 Hugging Face checkpoint with random weights and a tokenizer to `path`; returns the HF
    model (CPU, eval). A wide initializer makes greedy choices clear-cut, so identity tests meet few ties."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        model_type, vocab_size=shape.vocab_size or len(tokenizer), hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim, max_position_embeddings=shape.max_position_embeddings, rope_theta=shape.rope_theta,
        tie_word_embeddings=True, initializer_range=initializer_range, bos_token_id=1, eos_token_id=2,
        pad_token_id=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model
