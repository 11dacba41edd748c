"""A PEFT LoRA adapter read from its directory and laid out for our fused projections.

PEFT saves `lora_A` ([r, in]) and `lora_B` ([out, r]) per target module (q_proj, k_proj, ..., down_proj). Our
decoder fuses q|k|v into `qkv_proj` and gate|up into `gate_up_proj`, so an adapter's parts of one fused projection
are stacked: A rows at rank offsets `part * max_rank`, B (scaling folded in, stored transposed: [rank, out]) placed at
the part's output columns. One LoRA product per fused projection then serves every part, and the kernels
(engine/lora/kernels.py) see one shape per projection whatever the adapter targets.

An adapter's identity (`digest`) is a hash of these effective weights: what the model computes with it, not its
name or path. The prefix cache keys the adapter's blocks on it."""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.lora.patterns import compile_pattern, first_match

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_MODULES + MLP_MODULES
# PEFT module -> (our fused projection, part index in it)
FUSED_PART = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
              "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
PROJECTIONS = ("qkv", "o", "gate_up", "down")
UNSERVED = ("lm_head", "embed_tokens")
_WEIGHT_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")
_PEFT_PREFIX = "base_model.model."  # PEFT's saved names: this, then the module's name in the base model


@dataclass(frozen=True)
class ProjectionShape:
    """A fused projection's input size and its parts' output sizes (q, k, v; gate, up; or one part)."""

    in_features: int
    part_sizes: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.part_sizes)

    def part_offset(self, part: int) -> int:
        return sum(self.part_sizes[:part])


def projection_shapes(hf_config) -> dict[str, ProjectionShape]:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    return {"qkv": ProjectionShape(hidden, (q, kv, kv)), "o": ProjectionShape(q, (hidden,)),
            "gate_up": ProjectionShape(hidden, (inter, inter)), "down": ProjectionShape(inter, (hidden,))}


@dataclass(eq=False)
class LoRAAdapter:
    """An adapter's weights per (layer, projection): A [parts * max_rank, in] and B [parts * max_rank, out], float32,
    zero where the adapter has no part. `digest` names its effective weights."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    digest: str = ""

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * 4 + b.numel() * 4 for a, b in self.weights.values())


def load_adapter(path: str | Path, name: str, hf_config, max_rank: int) -> LoRAAdapter:
    """Read a PEFT adapter directory; ValueError with the reason when it cannot be served (a malformed config or
    weights file included: a request naming it fails alone)."""
    directory = Path(path)
    try:
        return _load(directory, name, hf_config, max_rank)
    except ValueError:
        raise
    except (OSError, RuntimeError, TypeError, KeyError, IndexError, AttributeError, EOFError,
            pickle.UnpicklingError) as error:  # a file torch or safetensors cannot read, or of the wrong kind
        raise ValueError(f"adapter {name!r}: {directory} cannot be read ({type(error).__name__}: {error})") from error


def _load(directory: Path, name: str, hf_config, max_rank: int) -> LoRAAdapter:
    config_path = directory / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"adapter {name!r}: {directory} has no adapter_config.json (a PEFT LoRA directory)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as error:
        raise ValueError(f"adapter {name!r}: adapter_config.json is not JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"adapter {name!r}: adapter_config.json holds a {type(config).__name__}, not an object")
    _check_config(name, config)
    scaling = _Scaling(name, config)
    tensors = _read_tensors(directory, name)
    shapes = projection_shapes(hf_config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    module_names: dict[tuple[int, str], str] = {}
    for key, tensor in tensors.items():
        unserved = next((module for module in UNSERVED if module in key), None)
        if unserved is not None:
            raise ValueError(f"adapter {name!r} trains {unserved} ({key}); tokenmill serves adapters of the "
                             f"attention and MLP projections only ({', '.join(TARGETS)}): merge that part into the "
                             "base model instead")
        match = _WEIGHT_NAME.search(key)
        if match is None or match.group(2) not in FUSED_PART:
            raise ValueError(f"adapter {name!r} has a weight tokenmill cannot place: {key} (LoRA on "
                             f"{', '.join(TARGETS)} only)")
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2 or tensor.is_complex():
            raise ValueError(f"adapter {name!r}: {key} is not a matrix of real numbers")
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= hf_config.num_hidden_layers:
            raise ValueError(f"adapter {name!r} has layer {layer}; the model has {hf_config.num_hidden_layers}")
        found.setdefault((layer, module), {})[which] = tensor.float()
        module_names[(layer, module)] = key[:key.rindex(".lora_")].removeprefix(_PEFT_PREFIX)
    if not found:
        raise ValueError(f"adapter {name!r} has no LoRA weights in {directory}")
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    top_rank = 0
    for (layer, module), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"adapter {name!r}: layer {layer} {module} has lora_A or lora_B missing")
        a, b = pair["A"], pair["B"]
        projection, part = FUSED_PART[module]
        shape = shapes[projection]
        rank = a.shape[0]
        if rank < 1 or a.shape != (rank, shape.in_features) or b.shape != (shape.part_sizes[part], rank):
            raise ValueError(f"adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}, which do not fit this model ({shape.in_features} in, "
                             f"{shape.part_sizes[part]} out): is it for another base model?")
        if rank > max_rank:
            raise ValueError(f"adapter {name!r} has rank {rank} (layer {layer} {module}), over max_lora_rank "
                             f"{max_rank}: start the engine with max_lora_rank >= {rank}")
        top_rank = max(top_rank, rank)
        scale = scaling.of(module_names[(layer, module)], rank)
        stacked = weights.get((layer, projection))
        if stacked is None:
            parts = len(shape.part_sizes)
            stacked = (torch.zeros(parts * max_rank, shape.in_features),
                       torch.zeros(parts * max_rank, shape.out_features))
            weights[(layer, projection)] = stacked
        rows = slice(part * max_rank, part * max_rank + rank)
        stacked[0][rows] = a
        offset = shape.part_offset(part)
        stacked[1][rows, offset:offset + shape.part_sizes[part]] = (b * scale).T
    adapter = LoRAAdapter(name, str(directory), top_rank, weights)
    adapter.digest = weights_digest(weights)
    return adapter


def weights_digest(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> str:
    h = hashlib.sha256()
    for (layer, projection), (a, b) in sorted(weights.items()):
        h.update(f"{layer}.{projection}:{tuple(a.shape)}:{tuple(b.shape)}".encode())
        h.update(a.contiguous().numpy().tobytes())
        h.update(b.contiguous().numpy().tobytes())
    return h.hexdigest()


def _check_config(name: str, config: dict) -> None:
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"adapter {name!r} is a {kind} adapter; tokenmill serves LoRA adapters")
    if config.get("use_dora"):
        raise ValueError(f"adapter {name!r} uses DoRA, which tokenmill does not serve")
    if config.get("bias", "none") != "none":
        raise ValueError(f"adapter {name!r} trains biases (bias={config['bias']!r}), which tokenmill does not serve")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"adapter {name!r} has fan_in_fan_out weights (Conv1D models), which tokenmill does not serve")
    saved = config.get("modules_to_save") or []
    if not _is_list_of_strings(saved):
        raise ValueError(f"adapter {name!r}: modules_to_save must be a list of module names, got {saved!r:.80}")
    if saved := [m for m in saved if m]:
        raise ValueError(f"adapter {name!r} also trains {', '.join(saved)} in full (modules_to_save); tokenmill "
                         f"serves LoRA on {', '.join(TARGETS)} only: merge those modules into the base model instead")
    targets = config.get("target_modules") or []
    if not isinstance(targets, str) and not _is_list_of_strings(targets):
        raise ValueError(f"adapter {name!r}: target_modules must be a list of module names or a pattern, got "
                         f"{targets!r:.80}")
    if isinstance(targets, list):
        unserved = [t for t in targets if t.split(".")[-1] not in TARGETS]
        if unserved:
            raise ValueError(f"adapter {name!r} targets {', '.join(unserved)}; tokenmill serves LoRA on "
                             f"{', '.join(TARGETS)} only")
    if not isinstance(config.get("use_rslora", False), (bool, type(None))):
        raise ValueError(f"adapter {name!r}: use_rslora must be true or false, got {config['use_rslora']!r:.80}")


class _Scaling:
    """PEFT's scaling of one module's product: `lora_alpha / r` (`/ sqrt(r)` with rsLoRA), alpha and r taken from
    the first key of `alpha_pattern` / `rank_pattern` matching the module's name (engine/lora/patterns.py). A config
    whose r disagrees with the weights' rank is refused: PEFT could not load it either."""

    def __init__(self, name: str, config: dict) -> None:
        self.name = name
        self.rank = config.get("r")
        self.alpha = config.get("lora_alpha")
        self.rslora = bool(config.get("use_rslora"))
        if self.rank is not None and not _is_rank(self.rank):
            raise ValueError(f"adapter {name!r}: r must be a positive integer, got {self.rank!r:.80}")
        if self.alpha is not None and not _is_number(self.alpha):
            raise ValueError(f"adapter {name!r}: lora_alpha must be a number, got {self.alpha!r:.80}")
        try:
            self.rank_pattern = compile_pattern(config.get("rank_pattern"), "rank_pattern")
            self.alpha_pattern = compile_pattern(config.get("alpha_pattern"), "alpha_pattern")
        except ValueError as error:
            raise ValueError(f"adapter {name!r}: {error}") from None
        for key, value in self.rank_pattern:
            if not _is_rank(value):
                raise ValueError(f"adapter {name!r}: rank_pattern[{key.key!r}] must be a positive integer, got "
                                 f"{value!r:.80}")
        for key, value in self.alpha_pattern:
            if not _is_number(value):
                raise ValueError(f"adapter {name!r}: alpha_pattern[{key.key!r}] must be a number, got {value!r:.80}")

    def of(self, module: str, rank: int) -> float:
        """The scaling of `module` (its full name in the base model) whose weights have `rank`."""
        configured = first_match(self.rank_pattern, module) or self.rank
        if configured is not None and configured != rank:
            raise ValueError(f"adapter {self.name!r}: {module} has weights of rank {rank} but its config gives "
                             f"r {configured} (r / rank_pattern)")
        alpha = first_match(self.alpha_pattern, module)
        alpha = (self.alpha if self.alpha is not None else rank) if alpha is None else alpha
        return alpha / math.sqrt(rank) if self.rslora else alpha / rank


def _is_rank(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_list_of_strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _read_tensors(directory: Path, name: str) -> dict[str, torch.Tensor]:
    safetensors_path, bin_path = directory / "adapter_model.safetensors", directory / "adapter_model.bin"
    if safetensors_path.is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(safetensors_path))
        except SafetensorError as error:
            raise ValueError(f"adapter {name!r}: {safetensors_path} is not a safetensors file ({error})") from None
    if bin_path.is_file():
        return torch.load(bin_path, map_location="cpu", weights_only=True)
    raise ValueError(f"adapter {name!r}: {directory} has no adapter_model.safetensors")
