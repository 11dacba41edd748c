"""Prepacked CPU GEMMs give F.linear's results at any number of rows: bit for bit through MKL and bfloat16's
oneDNN, within float32 rounding through float32's oneDNN; the AMX bfloat16 kernel within bfloat16 rounding, and
each row the same bits in any batch."""

import pytest
import torch
import torch.nn.functional as F

from engine.attention import cpu_kernel
from engine.models.cpu_gemm import (
    INVARIANT_ROWS,
    Linear,
    PackedWeight,
    fastest_float32_kernel,
    fixed_float32_kernel,
    float32_kernel,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weight_equals_f_linear_at_every_row_count(dtype, bias, monkeypatch):
    monkeypatch.setenv("TOKENMILL_FLOAT32_GEMM", "mkl")
    monkeypatch.setenv("TOKENMILL_BF16_GEMM", "onednn")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(960, 576, generator=generator).to(dtype)
    b = torch.randn(960, generator=generator).to(dtype) if bias else None
    packed = PackedWeight(weight, b)
    native = torch._C.has_mkl if dtype == torch.float32 else torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (packed.packed is not None) == native
    for rows in (1, 2, 7, 64, 129):
        x = torch.randn(rows, 576, generator=generator).to(dtype)
        assert torch.equal(packed(x), F.linear(x, weight, b)), f"{dtype} rows={rows}"


@pytest.mark.parametrize("bias", [False, True])
def test_bfloat16_on_amx_rounds_the_exact_sum_and_gives_a_row_the_same_bits_in_any_batch(bias, monkeypatch):
    """Where the CPU has AMX (else: oneDNN is chosen, and a shape the tiles don't cover also goes there)."""
    monkeypatch.delenv("TOKENMILL_BF16_GEMM", raising=False)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(960, 576, generator=generator).bfloat16()
    b = torch.randn(960, generator=generator).bfloat16() if bias else None
    packed = PackedWeight(weight, b)
    assert packed.kind == ("amx" if cpu_kernel.amx_ready() else "onednn")
    assert PackedWeight(torch.randn(100, 576).bfloat16()).kind == "onednn", "100 columns: not whole tiles"
    x = torch.randn(300, 576, generator=generator).bfloat16()
    full = packed(x)
    exact = x.float() @ weight.float().T + (b.float() if bias else 0)
    assert ((full.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-2).all(), "off by more than bf16 rounding"
    if packed.kind != "amx":
        return
    for first, end in ((0, 1), (5, 6), (17, 90), (63, 65), (100, 300), (299, 300)):
        assert torch.equal(packed(x[first:end]), full[first:end]), (first, end)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(packed(x[3:40]), full[3:40]), "one thread"
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bias", [False, True])
def test_float32_through_onednn_is_f_linear_within_rounding(bias, monkeypatch):
    monkeypatch.setenv("TOKENMILL_FLOAT32_GEMM", "onednn")
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(49152 // 16, 576, generator=generator)
    b = torch.randn(weight.shape[0], generator=generator) if bias else None
    packed = PackedWeight(weight, b)
    assert packed.packed is None or packed.kind == "onednn"
    for rows in (1, 7, 64, 129):
        x = torch.randn(rows, 576, generator=generator)
        torch.testing.assert_close(packed(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_the_float32_kernel_is_timed_once_per_shape_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("TOKENMILL_FLOAT32_GEMM", raising=False)
    chosen = float32_kernel(64, 32)
    assert chosen in ("mkl", "onednn")
    calls = fastest_float32_kernel.cache_info().hits
    assert float32_kernel(64, 32) == chosen and fastest_float32_kernel.cache_info().hits == calls + 1
    monkeypatch.setenv("TOKENMILL_FLOAT32_GEMM", "onednn")
    assert float32_kernel(64, 32) == "onednn"
    monkeypatch.setenv("TOKENMILL_FLOAT32_GEMM", "blas")
    with pytest.raises(ValueError, match="mkl or onednn"):
        float32_kernel(64, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "f_linear"])
def test_row_tiles_give_a_row_the_same_result_in_any_batch(dtype, packed):
    """Batch-invariant mode: a row alone, at any place of a tile, or among hundreds, bit for bit."""
    generator = torch.Generator().manual_seed(2)
    linear = Linear(576, 1536, bias=True).to(dtype)
    if packed:
        linear.pack()
    linear.set_row_tile(INVARIANT_ROWS)
    x = torch.randn(300, 576, generator=generator).to(dtype)
    full = linear(x)
    assert full.shape == (300, 1536)
    for first, end in ((0, 1), (5, 6), (17, 90), (63, 65), (100, 300), (299, 300)):
        assert torch.equal(linear(x[first:end]), full[first:end]), (first, end)
    shifted = torch.cat([torch.randn(7, 576, generator=generator).to(dtype), x[:20]])
    assert torch.equal(linear(shifted)[7:], full[:20])
    if packed and dtype == torch.float32:
        assert linear.packed.kind == fixed_float32_kernel()
