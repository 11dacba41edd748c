"""BERT-style encoder (BERT, MiniLM, ...) over one packed token batch: no padding, no KV cache.

The batch is rows ordered by length; rows of one length lie side by side, so attention runs on each run of
equal-length rows as one dense [rows, heads, length, head_dim] call without a mask (bidirectional, and no token
ever sees another row's). Everything else (embeddings, projections, MLP, LayerNorm) runs on the flat tokens.
Numerics follow Hugging Face's `BertModel` (post-LayerNorm, exact-erf GELU).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.cpu_gemm import Linear
from engine.pooling import pool

SUPPORTED_MODEL_TYPES = ("bert",)
ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class EncoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.head_dim = size // self.num_heads
        self.qkv = Linear(size, 3 * size)
        self.attn_out = Linear(size, size)
        self.attn_norm = nn.LayerNorm(size, eps=eps)
        self.up = Linear(size, config.intermediate_size)
        self.down = Linear(config.intermediate_size, size)
        self.out_norm = nn.LayerNorm(size, eps=eps)
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, groups: list[tuple[int, int, int]]) -> torch.Tensor:
        qkv = self.qkv(x)
        context = torch.empty_like(x)
        heads, dim = self.num_heads, self.head_dim
        for start, rows, length in groups:  # rows of one length: [rows * length] tokens from start
            end = start + rows * length
            q, k, v = qkv[start:end].view(rows, length, 3, heads, dim).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v)  # [rows, heads, length, dim]
            context[start:end] = out.transpose(1, 2).reshape(rows * length, heads * dim)
        x = self.attn_norm(self.attn_out(context) + x)
        return self.out_norm(self.down(self.act(self.up(x))) + x)


class BertEncoder(nn.Module):
    """Token ids (flat, rows ordered by length) -> one pooled vector per row."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported encoder model_type {config.model_type!r}; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"unsupported position_embedding_type {config.position_embedding_type!r} (absolute only)")
        size = config.hidden_size
        # plain tables: nn.Embedding's random init on the meta device would import torch._dynamo (seconds)
        self.word_embeddings = _table(config.vocab_size, size)
        self.position_embeddings = _table(config.max_position_embeddings, size)
        self.token_type_embeddings = _table(config.type_vocab_size, size)
        self.embed_norm = nn.LayerNorm(size, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.hidden_size = size

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, groups: list[tuple[int, int, int]],
                pooling: str) -> torch.Tensor:
        """token_ids, positions: [tokens]; groups: (first token, rows, length) of each run of equal-length rows.
        Returns [rows, hidden] float32 pooled vectors, in the rows' order."""
        x = F.embedding(token_ids, self.word_embeddings.weight)
        x = x + F.embedding(positions, self.position_embeddings.weight) + self.token_type_embeddings.weight[0]
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, groups)
        pooled = [pool(x[start:start + rows * length].view(rows, length, -1).float(), length, pooling)
                  for start, rows, length in groups]
        return torch.cat(pooled)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face `BertModel` (or `BertFor*` with a `bert.` prefix) names; the pooler head is not used."""
        params = dict(self.named_parameters())
        qkv_parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("bert.")
            if name.startswith(("pooler.", "cls.")) or name.endswith("position_ids"):
                continue
            target = _rename(name)
            if target is None:
                raise ValueError(f"unexpected encoder weight {name!r}")
            if isinstance(target, tuple):  # one of query/key/value: fused once all three are read
                index, part, kind = target
                qkv_parts.setdefault((index, kind), {})[part] = tensor
                continue
            params[target].data.copy_(tensor)
            loaded.add(target)
        for (index, kind), parts in qkv_parts.items():
            if set(parts) != {"query", "key", "value"}:
                missing = sorted({"query", "key", "value"} - set(parts))
                raise ValueError(f"layer {index}: attention {kind} is missing {missing}")
            target = f"layers.{index}.qkv.{kind}"
            params[target].data.copy_(torch.cat([parts["query"], parts["key"], parts["value"]]))
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"encoder weights missing from the checkpoint: {', '.join(missing[:5])}")

    def pack_for_cpu(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()


def _table(rows: int, size: int) -> nn.Module:
    table = nn.Module()
    table.weight = nn.Parameter(torch.empty(rows, size))
    return table


_LAYER_NAMES = {
    "attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "out_norm",
}


def _rename(name: str) -> str | tuple[int, str, str] | None:
    if name.startswith("embeddings."):
        rest = name.removeprefix("embeddings.")
        return "embed_norm." + rest.removeprefix("LayerNorm.") if rest.startswith("LayerNorm.") else rest
    if not name.startswith("encoder.layer."):
        return None
    index, _, rest = name.removeprefix("encoder.layer.").partition(".")
    module, _, kind = rest.rpartition(".")
    if module.startswith("attention.self."):
        return int(index), module.removeprefix("attention.self."), kind
    if module in _LAYER_NAMES:
        return f"layers.{index}.{_LAYER_NAMES[module]}.{kind}"
    return None
