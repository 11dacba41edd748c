"""The reference of multi-LoRA: Hugging Face greedy generation (float32) with a PEFT adapter merged into the base
model (`PeftModel.from_pretrained(...).merge_and_unload()`), one prompt at a time, stopping at EOS as the engine
does. The last models merged are kept, keyed on the adapter's path and its weights file's size and time, until the
test file ends (`forget_merged_models`)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

from tests.engine.identity import Reference, hf_greedy


def hf_peft_model(adapter_dir, model: str = "smollm2-135m"):
    """The float32 Hugging Face model with the adapter at `adapter_dir` merged (None: the base model)."""
    if adapter_dir is None:
        return _merged(None, None, model)
    weights = (Path(adapter_dir) / "adapter_model.safetensors").stat()
    return _merged(str(adapter_dir), (weights.st_size, weights.st_mtime_ns), model)


@lru_cache(maxsize=2)
def _merged(adapter_dir: str | None, version: tuple[int, int] | None, model: str):
    from transformers import AutoModelForCausalLM

    from engine.model_loader import resolve_model

    hf_model = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        hf_model = PeftModel.from_pretrained(hf_model, adapter_dir).merge_and_unload()
    return hf_model.eval()


def forget_merged_models() -> None:
    _merged.cache_clear()


def hf_peft_references(adapter_dir, prompts_token_ids: list[list[int]], max_tokens: int,
                       model: str = "smollm2-135m") -> list[Reference]:
    """Greedy tokens and HF's logits at each, for `identity.compare`'s near-tie allowance."""
    hf_model = hf_peft_model(adapter_dir, model)
    return hf_greedy(hf_model, [list(p) for p in prompts_token_ids], max_tokens)


def hf_peft_greedy(adapter_dir, prompts_token_ids: list[list[int]], max_tokens: int,
                   model: str = "smollm2-135m") -> list[list[int]]:
    """Each prompt's greedy tokens (at most `max_tokens`, up to and with EOS) with the adapter merged."""
    return [ref.tokens for ref in hf_peft_references(adapter_dir, prompts_token_ids, max_tokens, model)]
