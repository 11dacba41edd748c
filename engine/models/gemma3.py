"""Gemma 3 text decoder (transformers' `Gemma3ForCausalLM`) over one flat, unpadded token batch.

What sets it apart from the Llama family (engine/models/llama.py), each as transformers computes it:
- local and global layers interleaved (`layer_types`, or every `sliding_window_pattern`-th layer global): a local
  layer's query at position p attends to keys in (p - sliding_window, p]; the attention backend is told each
  layer's window (`layer_windows`);
- two RoPE bases: `rope_parameters[layer type]` (transformers 5), or `rope_theta` for global layers and
  `rope_local_base_freq` for local ones (older configs);
- RMSNorm with (1 + weight), computed in float32, applied to queries and keys per head (q/k norm) and four times
  per block: before and after attention, before and after the MLP;
- a gated GELU (tanh) MLP, the embedding scaled by sqrt(hidden_size), attention scaled by
  query_pre_attn_scalar^-0.5, the final logits soft-capped where `final_logit_softcapping` is set, and the LM head
  tied to the embedding.

Projections are fused as in the Llama model (one QKV and one gate/up matmul per layer) and run on the CPU's prepacked
GEMMs; the fused C decode layers are Llama's alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu_gemm import Linear, PackedWeight
from engine.models import checkpoint_target
from engine.models.llama import Attention, rotate_half

SUPPORTED_MODEL_TYPES = ("gemma3_text",)
SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + weight), in float32, cast back to x's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # F.rms_norm without a weight is bit-identical to HF's float32 formula (see llama.RMSNorm)
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


def layer_types(config) -> list[str]:
    """Each layer's attention: `layer_types`, else every `sliding_window_pattern`-th layer global (default 6)."""
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    pattern = getattr(config, "sliding_window_pattern", None) or getattr(config, "_sliding_window_pattern", 6)
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(config.num_hidden_layers)]


def rope_inv_freq(config, layer_type: str, head_dim: int) -> torch.Tensor:
    """The inverse frequencies of a layer type's RoPE, float32 [head_dim / 2] (default or linear scaling)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        params = dict(params[layer_type] or {})
    else:  # the older layout: one rope_theta (global), rope_local_base_freq (local), rope_scaling (global only)
        scaling = (getattr(config, "rope_scaling", None) or {}) if layer_type == FULL else {}
        theta = getattr(config, "rope_local_base_freq", 10000.0) if layer_type == SLIDING else \
            params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        params = {**scaling, "rope_theta": theta}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise ValueError(f"unsupported rope_type {rope_type!r} for Gemma 3 ({layer_type}); supported: default, "
                         "linear")
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    return inv_freq


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, index: int, layer_type: str) -> None:
        super().__init__()
        self.index = index
        self.layer_type = layer_type
        self.window = config.sliding_window if layer_type == SLIDING else None
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(config.hidden_size, sum(self.split), bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        # Our attention backends scale scores by head_dim^-0.5; Gemma scales by query_pre_attn_scalar^-0.5: the
        # queries carry the ratio where the two differ (exact where they agree, as in every Gemma 3 up to 12B).
        query_scale = config.query_pre_attn_scalar ** -0.5
        self.query_factor = None if query_scale == self.head_dim ** -0.5 else query_scale * math.sqrt(self.head_dim)

    def forward(self, x: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
                attention: Attention) -> torch.Tensor:
        tokens = x.shape[0]
        q_size, kv_size = self.split[0], self.split[1]
        qkv = self.qkv_proj(self.input_layernorm(x))
        q = self.q_norm(qkv[:, :q_size].reshape(tokens, self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, q_size:q_size + kv_size].reshape(tokens, self.num_kv_heads, self.head_dim))
        v = qkv[:, q_size + kv_size:]
        cos, sin = rope[self.layer_type]
        q = (q * cos + rotate_half(q) * sin).reshape(tokens, -1)
        k = (k * cos + rotate_half(k) * sin).reshape(tokens, -1)
        if self.query_factor is not None:
            q = q * self.query_factor
        attn = attention(self.index, q, k, v)
        x = x + self.post_attention_layernorm(self.o_proj(attn))
        gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(x)).split(self.intermediate_size, dim=-1)
        return x + self.post_feedforward_layernorm(self.down_proj(F.gelu(gate, approximate="tanh") * up))


class Gemma3ForCausalLM(nn.Module):
    """The engine's Gemma 3: the interface of engine/models/llama.py's `LlamaForCausalLM` that the runner, the memory
    plan and speculative decoding use (no LoRA, no tensor or pipeline parallelism yet)."""

    def __init__(self, config, max_positions: int, layers: range | None = None) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {config.model_type!r} is not Gemma 3 text ({SUPPORTED_MODEL_TYPES})")
        if layers is not None and layers != range(config.num_hidden_layers):
            raise ValueError("Gemma 3 does not run as pipeline stages yet")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("Gemma 3 with attn_logit_softcapping is not supported (transformers' Gemma 3 configs "
                             "leave it unset)")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention (an encoder) is not supported")
        if not getattr(config, "head_dim", None):
            config.head_dim = config.hidden_size // config.num_attention_heads
        self.config = config
        self.layer_range = range(config.num_hidden_layers)
        self.is_last_stage = True
        types = layer_types(config)
        if len(types) != config.num_hidden_layers or set(types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {config.num_hidden_layers} layers, each {SLIDING!r} or "
                             f"{FULL!r}; got {types}")
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, kind) for i, kind in enumerate(types))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.inv_freq: dict[str, torch.Tensor] = {}  # each layer type's RoPE frequencies (fill_rope_tables)
        self.packed_head: PackedWeight | None = None
        self.lora = None

    @property
    def layer_windows(self) -> list[int | None]:
        """Each layer's sliding window (None: global), what the attention backend masks by."""
        return [layer.window for layer in self.layers]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def attach_lora(self, manager) -> None:
        raise ValueError("LoRA adapters are served on Llama-family models only; Gemma 3 has no LoRA support yet")

    def fill_rope_tables(self, hf_config, max_positions: int) -> None:
        """Each layer type's RoPE frequencies, on the model's device (after loading: the model is built on meta). No
        cos and sin tables: they are computed per step from the positions (a table of both bases over 32k positions
        would hold 128 MiB), with the arithmetic of transformers' rotary embedding."""
        device = self.norm.weight.device
        self.inv_freq = {kind: rope_inv_freq(self.config, kind, self.config.head_dim).to(device)
                         for kind in sorted({layer.layer_type for layer in self.layers})}

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each layer type's cos and sin at `positions`, [T, 1, head_dim] in `dtype`."""
        tables = {}
        for kind, inv_freq in self.inv_freq.items():
            freqs = positions[:, None].float() * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            tables[kind] = (emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :])
        return tables

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                num_layers: int | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]; `num_layers` runs only the first layers (a
        self-speculative draft)."""
        x = self.embed_tokens(input_ids) if hidden is None else hidden
        if hidden is None:  # as transformers: the scale is a float32 scalar cast to the weights' dtype
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=torch.float32).to(x.dtype)
        rope = self.rope(positions, x.dtype)
        for layer in self.layers[:num_layers]:
            x = layer(x, rope, attention)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            logits = self.packed_head(hidden).float()
        else:
            logits = F.linear(hidden, self.lm_head_weight).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def pack_for_cpu(self) -> None:
        """Prepack every projection and the LM head for the CPU GEMM kernels (after loading and casting)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self.packed_head = PackedWeight(self.lm_head_weight)

    def set_row_tile(self, tile: int) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.set_row_tile(tile)
        if self.packed_head is None:
            self.packed_head = PackedWeight(self.lm_head_weight)
        self.packed_head.set_row_tile(tile)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load transformers' parameter names, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        fused = {"self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", 1),
                 "self_attn.v_proj": ("qkv_proj", 2), "mlp.gate_proj": ("gate_up_proj", 0),
                 "mlp.up_proj": ("gate_up_proj", 1)}
        renamed = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj", "self_attn.q_norm": "q_norm",
                   "self_attn.k_norm": "k_norm"}
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.").removeprefix("language_model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
                continue
            target, part = checkpoint_target(name, fused, renamed)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            param = params[target]
            with torch.no_grad():
                if part is None:
                    param.copy_(tensor)
                else:
                    layer = self.layers[int(target.split(".")[1])]
                    sizes = layer.split if "qkv_proj" in target else (layer.intermediate_size,) * 2
                    offset = sum(sizes[:part])
                    param[offset:offset + sizes[part]].copy_(tensor)
            loaded.add((target, part))
        expected: set[tuple[str, int | None]] = set()
        for name, _ in self.named_parameters():
            parts = 3 if "qkv_proj" in name else 2 if "gate_up_proj" in name else None
            expected.update((name, p) for p in range(parts)) if parts else expected.add((name, None))
        missing = sorted(f"{name}[{part}]" for name, part in expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")
