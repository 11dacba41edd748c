"""Llama-family decoder (Llama, Mistral-style, Qwen2, Qwen3) over one flat, unpadded token batch.

Numerics follow Hugging Face's implementation (RMSNorm in float32, RoPE tables in float32) so that
greedy decoding matches `transformers` token for token. Projections are fused: one QKV matmul and
one gate/up matmul per layer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernel
from engine.kernels.cpu_gemm import AMX_MAX_ROWS, Linear, PackedWeight
from engine.models import LLAMA_FAMILY, checkpoint_target

if TYPE_CHECKING:
    from engine.lora.manager import LoRAManager

Attention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

SUPPORTED_MODEL_TYPES = LLAMA_FAMILY


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The fused kernel is bit-identical to HF's float32 formula, x * rsqrt(mean(x^2) + eps).
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


def rope_tables(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for positions [0, max_positions), float32, [max_positions, head_dim]."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = head_dim_of(config)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        scaling = 1.0
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DecoderLayer(nn.Module):
    def __init__(self, config, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        self.qkv_proj = Linear(config.hidden_size, sum(self.split), bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = self.k_norm = None
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.intermediate_size = config.intermediate_size
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=mlp_bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lora: LoRAManager | None = None  # adds each row's adapter to the projections (engine/lora/)

    def project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """A projection (qkv, o, gate_up or down) of x, with this step's LoRA products added."""
        out = getattr(self, f"{name}_proj")(x)
        if self.lora is not None:
            self.lora.add(self.index, name, x, out)
        return out

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: Attention) -> torch.Tensor:
        tokens = x.shape[0]
        q_size = self.split[0]
        qkv = self.project("qkv", self.input_layernorm(x))
        qk, v = qkv[:, :-self.split[2]], qkv[:, -self.split[2]:]
        qk = qk.reshape(tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])], dim=1)
        qk = (qk * cos + rotate_half(qk) * sin).reshape(tokens, -1)  # RoPE on queries and keys at once
        attn = attention(self.index, qk[:, :q_size], qk[:, q_size:], v)
        x = x + self.project("o", attn)
        gate, up = self.project("gate_up", self.post_attention_layernorm(x)).split(self.intermediate_size, dim=-1)
        return x + self.project("down", F.silu(gate) * up)

    def forward_fused(self, normed: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                      rope: tuple[torch.Tensor, torch.Tensor], attention: Attention,
                      ops: cpu_kernel.LayerOps) -> torch.Tensor:
        """The same layer through the fused CPU ops: `normed` is input_layernorm(residual); adds the attention
        output to `residual` in place and returns the MLP's output (the next norm adds it)."""
        q_size, kv_size = self.split[0], self.split[1]
        qkv = self.project("qkv", normed)
        ops.rope_(qkv, self.num_heads + self.num_kv_heads, self.head_dim, positions, *rope)
        attn = attention(self.index, qkv[:, :q_size], qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:])
        norm = self.post_attention_layernorm
        normed = ops.rms_norm(self.project("o", attn), norm.weight, norm.eps, residual=residual)
        return self.project("down", ops.silu_mul(self.project("gate_up", normed)))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config, max_positions: int, layers: range | None = None) -> None:
        """`layers`: a pipeline stage's range of the model's layers (engine/distributed/pipeline.py), numbered from 0
        here; the first stage alone holds the embedding and the LM head, a later one starts from hidden states."""
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {config.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
        self.config = config
        self.layer_range = range(config.num_hidden_layers) if layers is None else layers
        self.is_last_stage = self.layer_range.stop == config.num_hidden_layers  # ends with the final norm
        self.embed_tokens = None  # built on meta, weights loaded after: nothing random or computed here (on meta,
        if self.layer_range.start == 0:  # those ops run as Python refs that import torch._dynamo, 1.7 s a process)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                             _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(len(self.layer_range)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None
        if not self.tie_word_embeddings and self.embed_tokens is not None:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        shape = (max_positions, head_dim_of(config))  # filled by model_loader.finish_loading (rope_tables)
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)
        self.packed_head: PackedWeight | None = None
        self.fused_ops: cpu_kernel.LayerOps | None = None  # set by pack_for_cpu where the C kernels build
        self.decode_layers: cpu_kernel.DecodeLayers | None = None  # the layers in one C call, where they run
        self.decode_rows_max: int | None = None  # more tokens than this take the Python loop
        self.lora: LoRAManager | None = None

    def attach_lora(self, manager: LoRAManager) -> None:
        """Serve LoRA adapters: every projection adds the step's rows' adapter products."""
        self.lora = manager
        for layer in self.layers:
            layer.lora = manager

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    layer_windows = None  # every layer attends to its whole context (Gemma 3 has sliding-window layers)

    def fill_rope_tables(self, hf_config, max_positions: int) -> None:
        """The RoPE tables of positions [0, max_positions), on the model's device (after loading its weights)."""
        cos, sin = rope_tables(hf_config, max_positions)
        device = self.norm.weight.device
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: Attention,
                num_layers: int | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states after the final norm, [num_tokens, hidden]; `num_layers` runs only the first
        layers (a self-speculative draft). The step's LoRA rows (`lora.begin_step`) apply to this pass only: a draft
        pass between steps runs without adapters. A pipeline stage after the first starts from `hidden` (the previous
        stage's output, which it may overwrite); one before the last returns the residual stream, without the norm."""
        try:
            x = self.embed_tokens(input_ids) if hidden is None else hidden
            if self.fused_ops is not None:
                return self._forward_fused(x, positions, attention, num_layers)
            cos = self.rope_cos.index_select(0, positions).to(x.dtype)[:, None, :]
            sin = self.rope_sin.index_select(0, positions).to(x.dtype)[:, None, :]
            for layer in self.layers[:num_layers]:
                x = layer(x, cos, sin, attention)
            return self.norm(x) if self.is_last_stage else x
        finally:
            if self.lora is not None:
                self.lora.end_step()

    def _forward_fused(self, residual: torch.Tensor, positions: torch.Tensor, attention: Attention,
                       num_layers: int | None) -> torch.Tensor:
        backend = getattr(attention, "__self__", None)  # the attention backend the bound `forward` belongs to
        plan = backend.kernel_plan() if self.decode_layers is not None and hasattr(backend, "kernel_plan") else None
        lora = None if self.lora is None or self.lora.step is None else self.lora.decode_layers_args()
        lora_fits = lora is not None or self.lora is None or self.lora.step is None
        if plan is not None and lora_fits and (self.decode_rows_max is None
                                               or residual.shape[0] <= self.decode_rows_max):
            normed = self.decode_layers.run(residual, positions, *plan, self.rope_tables_f32, backend.k_caches,
                                            backend.v_caches, num_layers, lora)
            return normed if self.is_last_stage else residual
        ops, layers = self.fused_ops, self.layers[:num_layers]
        first = layers[0].input_layernorm
        normed = ops.rms_norm(residual, first.weight, first.eps)
        for index, layer in enumerate(layers):
            out = layer.forward_fused(normed, residual, positions, self.rope_tables_f32, attention, ops)
            norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else self.norm
            normed = ops.rms_norm(out, norm.weight, norm.eps, residual=residual)
        return normed if self.is_last_stage else residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_head is not None:
            return self.packed_head(hidden).float()
        return F.linear(hidden, self.lm_head_weight).float()

    def pack_for_cpu(self) -> None:
        """Prepack every projection and the LM head for the CPU GEMM kernels (after loading and casting)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if self.embed_tokens is not None:
            self.packed_head = PackedWeight(self.lm_head_weight)
        if self.layers[0].q_norm is None and self.norm.weight.device.type == "cpu":
            self.fused_ops = cpu_kernel.layer_ops(self.norm.weight.dtype)
            self.rope_tables_f32 = (self.rope_cos.float(), self.rope_sin.float())  # exact: cast from float32
        self._build_decode_layers()

    def _build_decode_layers(self) -> None:
        """The one-call layers (cpu_kernel.DecodeLayers) where the fused ops run and every projection is packed
        for one of our own GEMM kinds; they stop at AMX_MAX_ROWS tokens where the projections would leave the AMX
        kernel for oneDNN (outside batch-invariant mode)."""
        self.decode_layers = self.decode_rows_max = None
        if self.fused_ops is None or os.environ.get("TOKENMILL_CPU_DECODE_LAYERS", "1") == "0":
            return
        projections = [(layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj) for layer in self.layers]
        if any(type(linear) is not Linear for group in projections for linear in group):
            return  # e.g. tensor parallelism's row-parallel projections, which all-reduce their output
        packed = [linear.packed for group in projections for linear in group]
        kinds = {p.kind if p is not None and p.packed is not None else None for p in packed}
        if len(kinds) != 1 or not kinds <= set(cpu_kernel.GEMM_KINDS):
            return
        kind = kinds.pop()
        weights = [cpu_kernel.DecoderLayerWeights(
            *(linear.packed.packed for linear in group), tuple(linear.packed.bias_f32 for linear in group),
            layer.input_layernorm.weight, layer.input_layernorm.eps, layer.post_attention_layernorm.weight,
            layer.post_attention_layernorm.eps) for layer, group in zip(self.layers, projections, strict=True)]
        first = self.layers[0]
        self.decode_layers = cpu_kernel.DecodeLayers(kind, self.norm.weight.dtype, weights, self.norm.weight,
                                                     self.norm.eps, first.num_heads, first.num_kv_heads,
                                                     first.head_dim, first.intermediate_size)
        if kind == "amx" and not packed[0].row_tile:
            self.decode_rows_max = AMX_MAX_ROWS

    def set_row_tile(self, tile: int) -> None:
        """Batch-invariant mode (`tile` > 0): every projection and the LM head in GEMMs of exactly `tile` rows."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.set_row_tile(tile)
        if self.packed_head is None and self.embed_tokens is not None:  # not packed (e.g. CUDA): F.linear, tiled
            self.packed_head = PackedWeight(self.lm_head_weight)
        if self.packed_head is not None:
            self.packed_head.set_row_tile(tile)
        if self.fused_ops is not None:  # float32 may have changed kernels; AMX's row limit is lifted
            self._build_decode_layers()

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face parameter names, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        fused = {  # hf suffix -> (our suffix, index of the part in the fused tensor)
            "self_attn.q_proj": ("qkv_proj", 0), "self_attn.k_proj": ("qkv_proj", 1),
            "self_attn.v_proj": ("qkv_proj", 2), "mlp.gate_proj": ("gate_up_proj", 0),
            "mlp.up_proj": ("gate_up_proj", 1),
        }
        renamed = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj",
                   "self_attn.q_norm": "q_norm", "self_attn.k_norm": "k_norm"}
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in weights:
            name = self.stage_name(name)
            if name is None or "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target, part = checkpoint_target(name, fused, renamed)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            param = params[target]
            with torch.no_grad():
                if part is None:
                    param.copy_(tensor)
                else:
                    self._copy_part(param, tensor, target, part)
            loaded.add((target, part))
        missing = sorted(f"{name}[{part}]" for name, part in self.expected_parts() - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:5])}")

    def stage_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this model (its layers numbered from the stage's first), or None where a
        pipeline stage does not hold it."""
        name = name.removeprefix("model.")
        if name.startswith("layers."):
            _, index, rest = name.split(".", 2)
            if int(index) not in self.layer_range:
                return None
            return f"layers.{int(index) - self.layer_range.start}.{rest}"
        if self.embed_tokens is None and name.split(".")[0] in ("embed_tokens", "lm_head"):
            return None
        return name

    def expected_parts(self) -> set[tuple[str, int | None]]:
        expected: set[tuple[str, int | None]] = set()
        for name, _ in self.named_parameters():
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                expected.update((name, part) for part in range(3))
            elif name.endswith("gate_up_proj.weight") or name.endswith("gate_up_proj.bias"):
                expected.update((name, part) for part in range(2))
            else:
                expected.add((name, None))
        return expected

    def _copy_part(self, param: torch.Tensor, tensor: torch.Tensor, target: str, part: int) -> None:
        layer = self.layers[int(target.split(".")[1])]
        sizes = layer.split if "qkv_proj" in target else (layer.intermediate_size,) * 2
        offset = sum(sizes[:part])
        param[offset:offset + sizes[part]].copy_(tensor)
