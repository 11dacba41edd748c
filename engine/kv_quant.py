"""FP8 KV cache (`kv_cache_dtype="fp8"`): blocks stored as e4m3 bytes (torch.float8_e4m3fn) with one scale per
layer, KV head and K or V; a stored byte times its head's scale is the value. Values beyond +-448 x scale saturate.

Scales are fixed for the engine's life, so a request's keys and values are stored the same way whatever ran
before it (batch invariance, the same bytes on every worker): calibrated once at start-up by running the model over
a built-in text (the largest |K| and |V| per layer and KV head, times HEADROOM, over 448), or given
(`kv_cache_scales`: a JSON file or a dict {"k": [[per head] per layer], "v": ...}, e.g. written by `save_scales`).

The attention kernels dequantise while they read (engine/attention/); nothing converts a whole pool.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.kv_cache_interface import KVScales

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.kv_cache_interface import ModelShape

log = logging.getLogger("tokenmill.engine")

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
HEADROOM = 2.0  # calibrated scales leave room for values twice the calibration text's largest
CALIBRATION_TEXT = (  # fixed: prose, dialogue, code, numbers, a list, several languages
    "The history of the lighthouse begins in the ancient world, when fires were lit on hilltops to guide ships "
    "home. The Pharos of Alexandria, built around 280 BC, stood more than 100 metres tall.\n"
    "User: Can you explain how a hash table works?\nAssistant: A hash table stores key-value pairs. A hash function "
    "maps each key to a bucket index; collisions are resolved by chaining or open addressing, so lookups take "
    "constant time on average.\n"
    "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n    for _ in range(n):\n"
    "        out.append(a)\n        a, b = b, a + b\n    return out\n\n"
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders USING (customer_id) GROUP BY name;\n"
    "Quarterly revenue: Q1 $1,234,567.89; Q2 $2,345,678.90 (+90.0%); Q3 3.14159e6; Q4 -42.\n"
    "Shopping list: 1. apples 2. bread 3. milk 4. eggs.\n"
    "Le chat dort sur le canapé. Der Hund spielt im Garten. El sol brilla sobre el mar. 東京は日本の首都です。\n"
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and arrows "
    "of outrageous fortune, or to take arms against a sea of troubles.\n"
    "Step 1: preheat the oven to 200 °C. Step 2: mix the flour, sugar and butter. Step 3: bake for 25 minutes.\n"
    "{\"id\": 17, \"tags\": [\"alpha\", \"beta\"], \"ok\": true, \"score\": 0.875}\n"
    "Photosynthesis converts light energy into chemical energy: 6 CO2 + 6 H2O -> C6H12O6 + 6 O2."
)


def is_fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in ("fp8", "fp8_e4m3")


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D] -> e4m3 of x / scale (scale [Hkv]), saturated at +-448, rounded to nearest even."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 x [Hkv, ...] (head-major, as the pool) -> x * scale[head] in `dtype`."""
    return (x.float() * scale.view(-1, *([1] * (x.dim() - 1)))).to(dtype)


def scales_from(setting: str | dict[str, Any], num_layers: int, num_kv_heads: int) -> KVScales:
    """Given scales: a dict {"k": ..., "v": ...} or the path of a JSON file holding one. Each of k and v is one
    number for every head, one per layer, or [layers][kv_heads]."""
    data = json.loads(Path(setting).read_text()) if isinstance(setting, str | Path) else setting
    if not isinstance(data, dict) or set(data) != {"k", "v"}:
        raise ValueError("kv_cache_scales must be {\"k\": ..., \"v\": ...} (or a JSON file of it)")
    out = []
    for name in ("k", "v"):
        values = torch.tensor(data[name], dtype=torch.float32)
        if values.dim() == 0:
            values = values.expand(num_layers)
        if values.dim() == 1:
            values = values[:, None].expand(-1, num_kv_heads)
        if values.shape != (num_layers, num_kv_heads):
            raise ValueError(f"kv_cache_scales[{name!r}] has shape {tuple(values.shape)}; the model needs "
                             f"({num_layers}, {num_kv_heads}) (layers, KV heads), one number per layer, or one")
        if not bool((values > 0).all()) or not bool(values.isfinite().all()):
            raise ValueError(f"kv_cache_scales[{name!r}] must be finite and > 0")
        out.append(values.contiguous())
    return KVScales(*out)


def save_scales(scales: KVScales, path: str | Path) -> None:
    Path(path).write_text(json.dumps(scales.to_dict()))


class _AmaxRecorder:
    """An attention function for the model's forward over one sequence: records each layer's largest |K| and |V|
    per KV head, and attends causally in plain torch (no pool)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.k = torch.zeros(num_layers, num_kv_heads)
        self.v = torch.zeros(num_layers, num_kv_heads)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        tokens, hkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        keys, values = k.reshape(tokens, hkv, d), v.reshape(tokens, hkv, d)
        self.k[layer] = keys.abs().amax(dim=(0, 2)).float().cpu()
        self.v[layer] = values.abs().amax(dim=(0, 2)).float().cpu()
        queries = q.reshape(tokens, -1, d).transpose(0, 1)
        group = queries.shape[0] // hkv
        keys, values = (x.transpose(0, 1).repeat_interleave(group, 0) for x in (keys, values))
        out = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, is_causal=True)
        return out.transpose(0, 1).reshape(tokens, -1)


def calibration_ids(model_dir: str | Path | None, vocab_size: int, length: int) -> list[int]:
    """CALIBRATION_TEXT's token ids (up to `length`) by the model's tokenizer; without one, a fixed spread of ids."""
    ids: list[int] = []
    if model_dir:
        try:
            from engine.hf_files import load_tokenizer

            ids = load_tokenizer(model_dir).encode(CALIBRATION_TEXT)
        except (OSError, ValueError):
            ids = []
    if not ids:
        ids = [(i * 7919 + 13) % vocab_size for i in range(length)]
    return [i % vocab_size for i in ids[:length]]


@torch.inference_mode()
def calibrate(model, model_dir: str | Path | None, num_layers: int, num_kv_heads: int, head_dim: int,
              vocab_size: int, max_len: int, device: torch.device) -> KVScales:
    """Scales from one forward of the model over CALIBRATION_TEXT: amax x HEADROOM / 448 per layer, KV head and K or
    V (1.0 where a head's values are all zero)."""
    ids = calibration_ids(model_dir, vocab_size, max_len)
    recorder = _AmaxRecorder(num_layers, num_kv_heads, head_dim)
    model(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), recorder)
    def scale(amax: torch.Tensor) -> torch.Tensor:
        return torch.where(amax > 0, amax * HEADROOM / FP8_MAX, torch.ones_like(amax)).contiguous()

    return KVScales(scale(recorder.k), scale(recorder.v))


def kv_scales_for(config: EngineConfig, shape: ModelShape, model) -> KVScales | None:
    """The FP8 pool's scales for the engine of `config` (None: the pool holds the model's dtype), calibrated on
    `model` unless given."""
    if not is_fp8(config.kv_cache_dtype):
        return None
    if config.kv_cache_scales is not None:
        scales = scales_from(config.kv_cache_scales, shape.num_layers, shape.num_kv_heads)
        log.info("FP8 KV cache: given scales (K %.3g-%.3g, V %.3g-%.3g)", scales.k.min(), scales.k.max(),
                 scales.v.min(), scales.v.max())
        return scales
    scales = calibrate(model, getattr(model.config, "_name_or_path", None), shape.num_layers, shape.num_kv_heads,
                       shape.head_dim, shape.vocab_size, min(shape.max_model_len, 512), shape.device)
    log.info("FP8 KV cache: scales calibrated on the built-in text (K %.3g-%.3g, V %.3g-%.3g, headroom %gx)",
             scales.k.min(), scales.k.max(), scales.v.min(), scales.v.max(), HEADROOM)
    return scales
