"""BERT-style encoder (BERT, MiniLM, ...) over one packed token batch: no KV cache, no padding in the
projections, the MLP or LayerNorm, which run on the flat tokens.

The batch is rows ordered by length. On CPU, where the C kernels build (engine/kernels/cpu_kernel.py),
attention runs over the packed rows with no padding at all, the residual add and LayerNorm are one pass, and
GELU runs inside the up projection's oneDNN GEMM. Otherwise attention runs per bucket of rows of like length (the
longest at most `BUCKET_SLACK` times the shortest) as one [rows, heads, longest, head_dim] call: a bucket of one
length needs no mask; otherwise its rows are padded to the longest for that call alone, with a key mask
(bidirectional, and no token ever sees another row's). Numerics follow Hugging Face's `BertModel`
(post-LayerNorm, exact-erf GELU).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import cpu_kernel
from engine.kernels.cpu_gemm import ONEDNN_ROWS, Linear, onednn_rows
from engine.pooling import pool

SUPPORTED_MODEL_TYPES = ("bert",)
BUCKET_SLACK = 1.5  # a bucket's longest row over its shortest: padding in attention against calls per layer
ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
ONEDNN_POST_OPS = {"gelu": ("gelu", "none"), "gelu_new": ("gelu", "tanh"), "gelu_pytorch_tanh": ("gelu", "tanh"),
                   "relu": ("relu", "")}  # hidden_act -> oneDNN post-op and its algorithm ("none": exact erf)


def post_ops_pay() -> bool:
    """oneDNN's GELU post-op beats a separate pass on AVX-512 CPUs; on AVX2 it slows the whole GEMM (AMD Zen 3,
    2,048 x 384 @ 384 x 1,536: 26 ms fused against 17.4 + 2.2 ms for the GEMM and torch's GELU after it)."""
    return "AVX512" in torch.backends.cpu.get_cpu_capability()


class EncoderLinear(Linear):
    """`Linear` followed by an activation (`act`: a key of `ACTIVATIONS`, or None), which runs inside the GEMM as
    a oneDNN post-op once the weight is packed for oneDNN (on CPUs where that pays), instead of as its own pass
    over the output."""

    def __init__(self, in_features: int, out_features: int, act: str | None = None) -> None:
        super().__init__(in_features, out_features)
        self.act = act
        self.post_op: tuple[str, str] | None = None

    def pack(self, own_kernels: bool = True, float32_split: bool = False) -> None:
        super().pack(own_kernels, float32_split)
        if self.act is not None and self.packed.packed is not None and self.packed.kind == "onednn" \
                and post_ops_pay():
            self.post_op = ONEDNN_POST_OPS[self.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post_op is not None and x.dim() == 2 and x.dtype == self.weight.dtype and not self.packed.row_tile:
            kind, algorithm = self.post_op
            return onednn_rows(lambda rows: torch.ops.mkldnn._linear_pointwise(rows, self.packed.packed, self.bias,
                                                                               kind, [], algorithm), x)
        out = super().forward(x)
        return out if self.act is None else ACTIVATIONS[self.act](out)


class EncoderLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.layer_norm_eps
        self.num_heads = config.num_attention_heads
        self.head_dim = size // self.num_heads
        self.qkv = Linear(size, 3 * size)
        self.attn_out = Linear(size, size)
        self.attn_norm = nn.LayerNorm(size, eps=eps)
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        self.up = EncoderLinear(size, config.intermediate_size, act=config.hidden_act)
        self.down = Linear(config.intermediate_size, size)
        self.out_norm = nn.LayerNorm(size, eps=eps)
        self.ops: cpu_kernel.EncoderOps | None = None  # set by pack_for_cpu where the C kernels build
        self.packed_attention = False  # the C kernel's attention over packed rows, else torch's per bucket

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """x: the batch's tokens, then any padding rows (zeros in, never read by a real token)."""
        qkv = self.qkv(x)
        tokens = len(batch.token_ids)
        if self.packed_attention:
            context = self.ops.packed_attention(qkv, batch.row_starts, batch.lengths, batch.longest, self.num_heads)
            context[tokens:].zero_()
        else:
            pieces = [self._attend(qkv[b.start:b.end], b) for b in batch.buckets]
            context = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            if x.shape[0] > tokens:
                context = F.pad(context, (0, 0, 0, x.shape[0] - tokens))
        if self.ops is not None:
            x = self.ops.add_layer_norm(self.attn_out(context), x, self.attn_norm)
            return self.ops.add_layer_norm(self.down(self.up(x)), x, self.out_norm)
        x = self.attn_norm(self.attn_out(context) + x)
        return self.out_norm(self.down(self.up(x)) + x)

    def _attend(self, qkv: torch.Tensor, bucket: Bucket) -> torch.Tensor:
        """[tokens, 3 * size] of one bucket's rows -> [tokens, size]."""
        rows, longest, size = bucket.rows, bucket.longest, qkv.shape[1] // 3
        if bucket.pad_index is not None:
            padded = qkv.new_zeros(rows * longest, qkv.shape[1])
            padded[bucket.pad_index] = qkv
            qkv = padded
        q, k, v = qkv.view(rows, longest, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bucket.mask)  # [rows, heads, longest, dim]
        out = out.transpose(1, 2).reshape(rows * longest, size)
        return out if bucket.pad_index is None else out[bucket.pad_index]


@dataclass
class Bucket:
    start: int  # its tokens in the packed batch: [start, end)
    end: int
    rows: int
    longest: int
    pad_index: torch.Tensor | None  # where each token sits in the padded [rows * longest]; None: no padding
    mask: torch.Tensor | None  # [rows, 1, 1, longest], True for real keys


@dataclass
class PackedBatch:
    """Rows (ordered by length) as one flat token batch, and what attention and pooling need to keep them apart."""

    token_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    row_of_token: torch.Tensor  # [tokens]
    row_starts: torch.Tensor  # [rows]
    lengths: torch.Tensor  # [rows]
    row_lengths: list[int]

    @functools.cached_property
    def longest(self) -> int:
        return max(self.row_lengths)

    @functools.cached_property
    def buckets(self) -> list[Bucket]:
        """Runs of like-length rows for the torch attention path (built on first use)."""
        lengths, device = self.row_lengths, self.token_ids.device
        buckets, start, first = [], 0, 0
        for i in range(1, len(lengths) + 1):
            if i == len(lengths) or lengths[i] > BUCKET_SLACK * lengths[first]:
                buckets.append(_bucket(lengths[first:i], start, device))
                start, first = buckets[-1].end, i
        return buckets

    @classmethod
    def of(cls, rows: list[list[int]], device: torch.device) -> PackedBatch:
        """rows: token ids, shortest first."""
        lengths = [len(r) for r in rows]
        lengths_t = torch.tensor(lengths)
        starts = torch.cumsum(lengths_t, 0) - lengths_t
        row_of_token = torch.repeat_interleave(torch.arange(len(rows)), lengths_t)
        positions = torch.arange(int(lengths_t.sum())) - starts[row_of_token]
        token_ids = torch.tensor([t for r in rows for t in r], dtype=torch.long)
        return cls(token_ids.to(device), positions.to(device), row_of_token.to(device), starts.to(device),
                   lengths_t.to(device), lengths)


def _bucket(lengths: list[int], start: int, device: torch.device) -> Bucket:
    rows, longest, tokens = len(lengths), max(lengths), sum(lengths)
    if all(n == longest for n in lengths):
        return Bucket(start, start + tokens, rows, longest, None, None)
    lengths_t = torch.tensor(lengths)
    real = torch.arange(longest)[None, :] < lengths_t[:, None]  # [rows, longest]
    pad_index = real.flatten().nonzero().squeeze(1)
    return Bucket(start, start + tokens, rows, longest, pad_index.to(device), real[:, None, None, :].to(device))


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
        self.ops: cpu_kernel.EncoderOps | None = None

    def forward(self, batch: PackedBatch, pooling: str) -> torch.Tensor:
        """Returns [rows, hidden] float32 pooled vectors, in the batch's row order."""
        x = F.embedding(batch.token_ids, self.word_embeddings.weight)
        extra = F.embedding(batch.positions, self.position_embeddings.weight) + self.token_type_embeddings.weight[0]
        x = self.embed_norm(x + extra) if self.ops is None else self.ops.add_layer_norm(x, extra, self.embed_norm)
        tokens = x.shape[0]
        if self.ops is not None and tokens > ONEDNN_ROWS:  # padded once here, not before every GEMM (onednn_rows)
            x = F.pad(x, (0, 0, 0, -tokens % ONEDNN_ROWS))
        for layer in self.layers:
            x = layer(x, batch)
        return pool(x[:tokens], batch.row_of_token, batch.row_starts, batch.lengths, pooling)

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

    def pack_for_cpu(self, float32_split: bool = False) -> None:
        """`float32_split`: float32 GEMMs as bfloat16 parts on AMX tiles where they run (`PackedWeight`)."""
        for module in self.modules():  # oneDNN: at an encoder's thousands of rows per batch it beats our AMX kernel
            if isinstance(module, Linear):
                module.pack(own_kernels=False, float32_split=float32_split)
        self.ops = cpu_kernel.encoder_ops(self.word_embeddings.weight.dtype)
        for layer in self.layers:  # the packed attention kernel takes head_dims of whole vectors only
            layer.ops = self.ops
            layer.packed_attention = self.ops is not None and packed_attention_preferred(self.ops, layer.head_dim) \
                and layer.head_dim % cpu_kernel.HEAD_DIM_MULTIPLE == 0


def packed_attention_preferred(ops: cpu_kernel.EncoderOps, head_dim: int) -> bool:
    """The C kernel's attention over packed rows (no padding), or torch's fused attention per bucket of like-length
    rows: `TOKENMILL_ENCODER_ATTENTION=packed|torch`, else packed (on AMX tiles where it runs there), except in
    bfloat16 on CPUs with AMX where the tiles don't take the head_dim: torch's multiplies on the tiles there and the
    packed kernel would not (all-MiniLM-L6-v2 on an Intel Xeon, 2 threads: 344 -> 420 sentences/s in bfloat16). In
    float32 the packed kernel is the faster everywhere (that Xeon: attention 0.95 -> 0.4 s of 1,500 sentences)."""
    forced = os.environ.get("TOKENMILL_ENCODER_ATTENTION")
    if forced not in (None, "", "packed", "torch"):
        raise ValueError(f"TOKENMILL_ENCODER_ATTENTION must be packed or torch, not {forced!r}")
    if forced:
        return forced == "packed"
    return ops.tiles_take(head_dim) or ops.dtype != torch.bfloat16 or not torch.cpu._is_amx_tile_supported()


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
