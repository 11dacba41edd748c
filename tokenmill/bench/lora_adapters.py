"""Test LoRA adapters for the bundled model: PEFT directories (adapter_config.json + adapter_model.safetensors) made
with `peft` on the Hugging Face model, their weights seeded random values instead of PEFT's initialisation (which
zeroes B, an adapter that changes nothing). Each adapter moves every targeted projection by about `scale` of the
projection's own weights (more when fewer projections are targeted): enough for greedy text that differs from the
base model's and between adapters, still text. Made once per argument set: a directory whose marker matches the
arguments is reused."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MARKER = "tokenmill-adapter.json"  # written last: its arguments are what the directory holds
DEFAULT_SCALE = 0.05  # 0.1 still reads as text, 0.15 often repeats itself, 0.25 is gibberish


def make_adapters(out_dir, count: int, rank: int = 16, targets=ALL_PROJECTIONS, seed: int = 0,
                  model: str = "smollm2-135m", alpha: int | None = None, scale: float | None = None) -> list[Path]:
    """`count` distinct adapters of `rank` on `targets`, out_dir/lora-0 ... lora-{count-1}; the same arguments give
    the same weights. `alpha` is PEFT's lora_alpha (default: 2 * rank); `scale` the RMS of each projection's change
    over the RMS of its base weights (default: DEFAULT_SCALE with all seven projections, times sqrt(7 / targets)
    with fewer)."""
    targets = tuple(targets)
    unknown = set(targets) - set(ALL_PROJECTIONS)
    if unknown or not targets:
        raise ValueError(f"targets must be among {', '.join(ALL_PROJECTIONS)}, not {sorted(unknown) or 'none'}")
    alpha = 2 * rank if alpha is None else alpha
    scale = DEFAULT_SCALE * (len(ALL_PROJECTIONS) / len(set(targets)))**0.5 if scale is None else scale
    out = Path(out_dir)
    dirs = [out / f"lora-{index}" for index in range(count)]
    wanted = [{"model": model, "rank": rank, "targets": list(targets), "seed": seed, "index": index,
               "alpha": alpha, "scale": scale} for index in range(count)]
    missing = [(d, w) for d, w in zip(dirs, wanted, strict=True) if _marker(d) != w]
    if missing:
        _build(missing, model, rank, targets, alpha, scale)
    return dirs


def _marker(directory: Path) -> dict | None:
    try:
        return json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _build(missing: list[tuple[Path, dict]], model: str, rank: int, targets: tuple[str, ...], alpha: int,
           scale: float) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engine.model_loader import resolve_model

    base = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(base, config)
    layers = [(module, float(module.base_layer.weight.detach().square().mean().sqrt()))  # with the base RMS
              for module in peft_model.modules() if hasattr(module, "lora_A") and "default" in module.lora_A]
    for directory, arguments in missing:
        generator = torch.Generator().manual_seed(_seed(arguments))
        with torch.no_grad():
            for module, weight_rms in layers:
                _randomize(module, generator, rank, alpha, scale * weight_rms)
        shutil.rmtree(directory, ignore_errors=True)
        peft_model.save_pretrained(str(directory))
        (directory / MARKER).write_text(json.dumps(arguments))


def _seed(arguments: dict) -> int:
    """A generator seed of (seed, index, rank, targets, model): adapters of different arguments never coincide."""
    key = json.dumps({k: arguments[k] for k in ("model", "rank", "targets", "seed", "index")}, sort_keys=True)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def _randomize(module, generator, rank: int, alpha: int, rms: float) -> None:
    """A ~ N(0, 1/in), B ~ N(0, 1/rank), then B scaled so (alpha / rank) * B @ A has entries of about `rms`."""
    import torch

    lora_a, lora_b = module.lora_A["default"].weight, module.lora_B["default"].weight
    in_features = lora_a.shape[1]
    lora_a.copy_(torch.randn(lora_a.shape, generator=generator) / in_features**0.5)
    lora_b.copy_(torch.randn(lora_b.shape, generator=generator) * (rms * (in_features * rank)**0.5 / alpha))
