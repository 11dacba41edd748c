"""The generative architectures the engine runs, picked from a Hugging Face config's `model_type` (or its
`architectures`). Modules are named, not imported, so reading this table costs no torch import."""

from __future__ import annotations

import importlib
from typing import Any

# model_type -> (module, class); the HF class names of `architectures` they stand for
CAUSAL_LMS = {
    "llama": ("engine.models.llama", "LlamaForCausalLM"),
    "mistral": ("engine.models.llama", "LlamaForCausalLM"),
    "qwen2": ("engine.models.llama", "LlamaForCausalLM"),
    "qwen3": ("engine.models.llama", "LlamaForCausalLM"),
    "gemma3_text": ("engine.models.gemma3", "Gemma3ForCausalLM"),
}
ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3_text",
}
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")  # what tensor and pipeline parallelism, LoRA and the C decode
# layers run


def supported() -> str:
    return (f"model_type one of {', '.join(CAUSAL_LMS)} (architectures {', '.join(ARCHITECTURES)}); "
            "a Gemma 3 multimodal checkpoint (Gemma3ForConditionalGeneration) is not, its text part is")


def model_type_of(hf_config: Any) -> str:
    """The config's model_type where the engine runs it; else ValueError naming the supported ones (and, where the
    config names an architecture the engine knows under another model_type, that one)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in CAUSAL_LMS:
        return model_type
    architectures = getattr(hf_config, "architectures", None) or []
    raise ValueError(f"unsupported model: model_type {model_type!r}, architectures {architectures}; supported: "
                     f"{supported()}")


def causal_lm_class(hf_config: Any) -> type:
    """The engine's model class for a config (see `model_type_of`)."""
    module, name = CAUSAL_LMS[model_type_of(hf_config)]
    return getattr(importlib.import_module(module), name)


def is_llama_family(hf_config: Any) -> bool:
    return model_type_of(hf_config) in LLAMA_FAMILY


def check_supported(hf_config: Any, config: Any) -> None:
    """ValueError, before anything loads, for an architecture the engine does not run or a feature of the
    `EngineConfig` that only the Llama family has (tensor and pipeline parallelism, LoRA)."""
    if is_llama_family(hf_config):
        return
    unsupported = [name for name, on in (("tensor_parallel_size > 1", config.tensor_parallel_size > 1),
                                         ("pipeline_parallel_size > 1", config.pipeline_parallel_size > 1),
                                         ("enable_lora", config.enable_lora)) if on]
    if unsupported:
        raise ValueError(f"{', '.join(unsupported)}: Llama-family models only; {hf_config.model_type} does not "
                         f"support it yet")


def checkpoint_target(name: str, fused: dict[str, tuple[str, int]], renamed: dict[str, str]) -> tuple[str, int | None]:
    """A checkpoint tensor's parameter in our model and, for a fused one (`fused`: HF name -> (ours, part)), its
    part; `renamed`: HF names that are ours under another name."""
    target, part = name, None
    for hf, (ours, index) in fused.items():
        if f".{hf}." in name:
            target, part = name.replace(hf, ours), index
    for hf, ours in renamed.items():
        target = target.replace(f".{hf}.", f".{ours}.")
    return target, part
