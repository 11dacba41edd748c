"""LoRA adapters served beside the base model (multi-LoRA): requests name an adapter with a `LoRARequest`, a
batch mixes adapters and the base model, and each projection adds one gathered LoRA product for the whole batch
(engine/lora/kernels.py). The prefix cache keys an adapter's blocks on a digest of its weights and config, not its
name (engine/lora/adapter.py)."""

from engine.lora.request import LoRARequest

__all__ = ["LoRARequest"]
