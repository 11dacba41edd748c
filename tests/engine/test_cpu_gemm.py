"""Prepacked CPU GEMMs give F.linear's results at any number of rows: bit for bit through MKL and bfloat16's
oneDNN, within float32 rounding through float32's oneDNN; our AMX and AVX-512 kernels within their dtype's
rounding of the exact sum, and each row the same bits in any batch."""

import json

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_kernel
from engine.kernels.cpu_gemm import (
    INVARIANT_ROWS,
    Linear,
    PackedWeight,
    fastest_float32_kernel,
    float32_kernel,
    onednn_rows,
)
from tests.engine.cpu_flags import (
    amx_expected,
    avx512_expected,
    expected_bfloat16_kernel,
    expected_fixed_float32_kernel,
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


def own_kernels_here() -> list[tuple[str, torch.dtype]]:
    """From the CPU's flags: a build that lost a kernel fails its case here rather than dropping it."""
    kinds = [("amx", torch.bfloat16)] if amx_expected() else []
    return kinds + [("avx512", dtype) for dtype in (torch.bfloat16, torch.float32) if avx512_expected(dtype)]


def test_bfloat16_takes_our_kernel_where_the_cpu_has_one_and_the_shape_fits(monkeypatch):
    monkeypatch.delenv("TOKENMILL_BF16_GEMM", raising=False)
    assert PackedWeight(torch.randn(960, 576).bfloat16()).kind == expected_bfloat16_kernel()
    assert PackedWeight(torch.randn(100, 576).bfloat16()).kind == "onednn", "100 columns: not whole slices"
    assert PackedWeight(torch.randn(960, 576).bfloat16(), own_kernels=False).kind == "onednn"
    monkeypatch.setenv("TOKENMILL_BF16_GEMM", "onednn")
    assert PackedWeight(torch.randn(960, 576).bfloat16()).kind == "onednn"
    monkeypatch.setenv("TOKENMILL_BF16_GEMM", "blas")
    with pytest.raises(ValueError, match="amx, avx512 or onednn"):
        PackedWeight(torch.randn(960, 576).bfloat16())


@pytest.mark.parametrize("kind,dtype", own_kernels_here() or [pytest.param(
    "avx512", torch.float32, marks=pytest.mark.skip(reason="this CPU has neither AMX nor AVX-512"))])
@pytest.mark.parametrize("bias", [False, True])
def test_our_kernels_round_the_exact_sum_and_give_a_row_the_same_bits_in_any_batch(kind, dtype, bias, monkeypatch):
    """Each of our GEMM kernels this CPU runs (AMX bfloat16; AVX-512 bfloat16 and float32)."""
    monkeypatch.setenv("TOKENMILL_BF16_GEMM", kind)
    monkeypatch.setenv("TOKENMILL_FLOAT32_GEMM", kind)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(960, 576, generator=generator).to(dtype)
    b = torch.randn(960, generator=generator).to(dtype) if bias else None
    packed = PackedWeight(weight, b)
    assert packed.kind == kind and packed.invariant_kernel
    x = torch.randn(300, 576, generator=generator).to(dtype)
    full = packed(x)
    exact = x.double() @ weight.double().T + (b.double() if bias else 0)
    tolerance = exact.abs() * 2 ** -8 + 1e-2 if dtype == torch.bfloat16 else exact.abs() * 1e-5 + 1e-3
    assert ((full.double() - exact).abs() <= tolerance).all(), "off by more than the dtype's rounding"
    for first, end in ((0, 1), (5, 6), (11, 13), (17, 90), (63, 65), (100, 300), (299, 300)):
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
    assert chosen in ("mkl", "onednn", "avx512")
    calls = fastest_float32_kernel.cache_info().hits
    assert float32_kernel(64, 32) == chosen and fastest_float32_kernel.cache_info().hits == calls + 1
    monkeypatch.setenv("TOKENMILL_FLOAT32_GEMM", "onednn")
    assert float32_kernel(64, 32) == "onednn"
    assert float32_kernel(64, 32, own_kernels=False) in ("mkl", "onednn")
    monkeypatch.setenv("TOKENMILL_FLOAT32_GEMM", "blas")
    with pytest.raises(ValueError, match="mkl, onednn or avx512"):
        float32_kernel(64, 32)


def test_the_float32_choice_is_kept_for_the_next_process(monkeypatch, tmp_path):
    """A worker's next start reads the timed choice from $TOKENMILL_HOME/gemm-choices.json instead of timing."""
    from engine.kernels import cpu_gemm

    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path))
    timed = []
    monkeypatch.setattr(cpu_gemm, "_time_float32_kernels", lambda *args: timed.append(args) or "onednn")
    shape = (96, 40)
    fastest_float32_kernel.__wrapped__(*shape)  # a fresh process: nothing in functools' cache
    assert len(timed) == 1 and "96x40" in next(iter(json.loads((tmp_path / "gemm-choices.json").read_text())))
    assert fastest_float32_kernel.__wrapped__(*shape) == "onednn" and len(timed) == 1  # read, not timed again
    (tmp_path / "gemm-choices.json").write_text("{not json")  # a damaged file: timed again, and rewritten
    assert fastest_float32_kernel.__wrapped__(*shape) == "onednn" and len(timed) == 2
    assert len(json.loads((tmp_path / "gemm-choices.json").read_text())) == 1


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
        assert linear.packed.kind == expected_fixed_float32_kernel()  # 1536 x 576: 32-column multiples


def test_long_inputs_reach_onednn_padded_to_a_multiple_of_its_rows():
    """oneDNN compiles a kernel per new row count: prefills and encoder batches of any length share a few."""
    seen = []

    def linear(x):
        seen.append(x.shape[0])
        return x * 2

    x = torch.randn(130, 8)
    assert torch.equal(onednn_rows(linear, x), x * 2) and seen == [192]
    assert torch.equal(onednn_rows(linear, x[:64]), x[:64] * 2) and seen[-1] == 64  # short inputs as they come


@pytest.mark.skipif(not amx_expected(), reason="float32 as bfloat16 parts runs on AMX tiles only")
@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("shape", [(960, 576), (384, 1536)], ids=["slice_outer", "depth_outer"])
def test_float32_as_bfloat16_parts_on_amx_is_near_float32_and_the_same_bits_in_any_batch(parts, shape):
    """3 products of 2 parts keep about 16 bits (PyTorch's "high"); 6 of 3 parts are as close to the exact sum as
    float32's own GEMM. Either way far closer than one bfloat16 product, and each row's bits fixed in any batch."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(*shape, generator=generator) / 20
    bias = torch.randn(shape[0], generator=generator)
    x = torch.randn(300, shape[1], generator=generator)
    packed = cpu_kernel.split_pack(weight, parts)
    full = cpu_kernel.split_linear(x, packed, bias, shape[0], parts)
    exact = x.double() @ weight.double().T + bias.double()

    def error(y: torch.Tensor) -> float:
        return ((y.double() - exact).abs().max() / exact.abs().max()).item()

    float32_error = error(F.linear(x, weight, bias))
    bfloat16_error = error(F.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16()).float())
    assert error(full) <= (4 * float32_error if parts == 3 else 2 ** -15), (error(full), float32_error)
    assert error(full) * 100 < bfloat16_error
    for first, end in ((0, 1), (5, 6), (11, 13), (17, 90), (100, 300), (299, 300)):
        assert torch.equal(cpu_kernel.split_linear(x[first:end], packed, bias, shape[0], parts), full[first:end])
    no_bias = cpu_kernel.split_linear(x[:40], packed, None, shape[0], parts)
    assert torch.allclose(no_bias, full[:40] - bias, rtol=1e-4, atol=1e-5)


def test_float32_split_is_asked_for_and_runs_where_the_cpu_has_amx():
    weight = torch.randn(960, 576)
    packed = PackedWeight(weight, float32_split=True)
    assert (packed.kind == "amx_split") == amx_expected()
    assert packed.invariant_kernel or not amx_expected()
    x = torch.randn(37, 576)
    reference = F.linear(x, weight)
    assert (packed(x) - reference).abs().max() <= 2 ** -14 * reference.abs().max()
    assert PackedWeight(weight).kind != "amx_split"
