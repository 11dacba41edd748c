"""The CPU encoder ops (csrc/encoder_ops.c) against torch: attention over packed rows of mixed lengths (each row
alone through SDPA) and the residual add + LayerNorm; float32 within rounding, bfloat16 within one bfloat16
rounding."""

import pytest
import torch
import torch.nn.functional as F

from engine.attention import cpu_kernel

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def dtype(request):
    return request.param


@pytest.fixture
def ops(dtype):
    ops = cpu_kernel.encoder_ops(dtype)
    assert ops is not None, "this machine has a C compiler: the kernels must build"
    return ops


@pytest.mark.parametrize("lengths", [[1], [3, 3, 17], [5, 16, 33, 70]])
def test_packed_attention_is_each_row_alone(ops, dtype, lengths):
    generator = torch.Generator().manual_seed(len(lengths))
    heads, head_dim = 4, 32
    qkv = torch.randn(sum(lengths), 3 * heads * head_dim, generator=generator).to(dtype)
    lengths_t = torch.tensor(lengths)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    out = ops.packed_attention(qkv, starts, lengths_t, max(lengths), heads)
    for start, length in zip(starts.tolist(), lengths, strict=True):
        row = qkv[start:start + length].float().view(length, 3, heads, head_dim).permute(1, 2, 0, 3)
        expected = F.scaled_dot_product_attention(row[0], row[1], row[2]).transpose(0, 1).reshape(length, -1)
        torch.testing.assert_close(out[start:start + length], expected.to(dtype), **TOLERANCE[dtype])


@pytest.mark.parametrize("rows", [1, 40])
def test_add_layer_norm(ops, dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 384, generator=generator).to(dtype) for _ in range(2))
    norm = torch.nn.LayerNorm(384, eps=1e-12).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(384, generator=generator))
        norm.bias.copy_(0.1 * torch.randn(384, generator=generator))
        torch.testing.assert_close(ops.add_layer_norm(x, residual, norm), norm(x + residual), **TOLERANCE[dtype])
