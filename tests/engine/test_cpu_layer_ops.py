"""The fused CPU layer ops against torch, float32 within rounding, bfloat16 within one bfloat16 rounding: a decoder
layer's (csrc/layer_ops.c) against Hugging Face's Llama formulas: RMSNorm with the residual add, RoPE in place on a
strided QKV row, SiLU(gate) * up; an encoder layer's (csrc/encoder_ops.c): attention over packed rows of mixed
lengths (each row alone through SDPA) and the residual add + LayerNorm."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernel
from engine.models.llama import rotate_half

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def dtype(request):
    return request.param


@pytest.fixture
def ops(dtype):
    ops = cpu_kernel.layer_ops(dtype)
    assert ops is not None, "this machine has a C compiler: the kernels must build"
    return ops


@pytest.fixture
def encoder_ops(dtype):
    ops = cpu_kernel.encoder_ops(dtype)
    assert ops is not None, "this machine has a C compiler: the kernels must build"
    return ops


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_rms_norm_with_and_without_the_residual_add(ops, dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 576, generator=generator).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(576, generator=generator)).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5), **TOLERANCE[dtype])
    expected_sum = residual + x
    out = ops.rms_norm(x, weight, 1e-5, residual=residual)
    assert torch.equal(residual, expected_sum), "the residual add is one rounding, like torch's"
    torch.testing.assert_close(out, hf_rms_norm(expected_sum, weight, 1e-5), **TOLERANCE[dtype])


@pytest.mark.parametrize("tokens", [1, 33])
def test_rope_rotates_queries_and_keys_in_place_and_leaves_values(ops, dtype, tokens):
    generator = torch.Generator().manual_seed(tokens)
    heads, kv_heads, d = 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=generator).to(dtype)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.arange(256).float()[:, None] * inv_freq[None]] * 2, dim=-1)
    cos, sin = emb.cos(), emb.sin()
    positions = torch.randint(0, 256, (tokens,), generator=generator)
    qk = qkv[:, :(heads + kv_heads) * d].reshape(tokens, heads + kv_heads, d)
    c, s = cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None]
    expected = (qk * c + rotate_half(qk) * s).reshape(tokens, -1)
    values = qkv[:, (heads + kv_heads) * d:].clone()
    ops.rope_(qkv, heads + kv_heads, d, positions, cos, sin)
    torch.testing.assert_close(qkv[:, :(heads + kv_heads) * d], expected, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * d:], values)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (20, 1536), (3, 40)])
def test_silu_mul(ops, dtype, rows, inter):
    """40 columns: the AVX-512 bfloat16 loop's scalar tail too."""
    gate_up = (3 * torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows))).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up, **TOLERANCE[dtype])


SUBNORMALS_AFTER_KERNELS = """
import platform, sys, torch
torch.set_num_threads(2)
from engine.kernels import cpu_kernel
dtype = getattr(torch, sys.argv[1])
ops = cpu_kernel.layer_ops(dtype)
many = torch.full((1 << 22,), 1e-39)  # large enough for torch to split it over its threads
bits = many.view(torch.int32)  # compared as integers: a float compare would itself read subnormals as zero
def kept():
    return torch.equal((many * 1.0).view(torch.int32), bits)
assert kept(), "subnormals kept to begin with"
gate_up = torch.cat([torch.full((40, 1536), 1e-39), torch.ones(40, 1536)], dim=1).to(dtype)
out = ops.silu_mul(gate_up)  # 40 rows: the OpenMP workers run it too
flushed = platform.machine() in ("x86_64", "AMD64")  # the x86 MXCSR; other CPUs keep them
assert (torch.count_nonzero(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)) == 0) == flushed, \\
    "silu(1e-39) * 1 is flushed to zero inside the kernel"
assert kept(), "back in the caller and on torch's OpenMP workers, subnormals survive again"
x = torch.randn(40, 576).to(dtype)
ops.rms_norm(x, torch.ones(576, dtype=dtype), 1e-5, residual=torch.zeros_like(x))
assert kept()
"""


def test_kernels_flush_subnormals_inside_and_leave_every_threads_mode_as_it_was(dtype):
    """The kernels run with subnormals flushed (Intel cores take a microcode assist per subnormal), then every thread
    puts its floating-point mode back: torch's own ops after them, on its OpenMP workers too, still keep subnormals.
    In a fresh interpreter that imports torch first, as the engine does: the kernels then share torch's libgomp and
    its worker threads (under pytest another libgomp may be loaded first, and the threads not shared)."""
    done = subprocess.run([sys.executable, "-c", SUBNORMALS_AFTER_KERNELS, str(dtype).removeprefix("torch.")],
                          capture_output=True, text=True, cwd=Path(__file__).parents[2], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_LAYER_OPS", "0")
    assert cpu_kernel.layer_ops(torch.float32) is None


@pytest.mark.parametrize("lengths", [[1], [3, 3, 17], [5, 16, 33, 70]])
def test_packed_attention_is_each_row_alone(encoder_ops, dtype, lengths):
    generator = torch.Generator().manual_seed(len(lengths))
    heads, head_dim = 4, 32
    qkv = torch.randn(sum(lengths), 3 * heads * head_dim, generator=generator).to(dtype)
    lengths_t = torch.tensor(lengths)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    out = encoder_ops.packed_attention(qkv, starts, lengths_t, max(lengths), heads)
    for start, length in zip(starts.tolist(), lengths, strict=True):
        row = qkv[start:start + length].float().view(length, 3, heads, head_dim).permute(1, 2, 0, 3)
        expected = F.scaled_dot_product_attention(row[0], row[1], row[2]).transpose(0, 1).reshape(length, -1)
        torch.testing.assert_close(out[start:start + length], expected.to(dtype), **TOLERANCE[dtype])


@pytest.mark.parametrize("rows", [1, 40])
def test_add_layer_norm(encoder_ops, dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, 384, generator=generator).to(dtype) for _ in range(2))
    norm = torch.nn.LayerNorm(384, eps=1e-12).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(384, generator=generator))
        norm.bias.copy_(0.1 * torch.randn(384, generator=generator))
        fused = encoder_ops.add_layer_norm(x, residual, norm)
        torch.testing.assert_close(fused, norm(x + residual), **TOLERANCE[dtype])
