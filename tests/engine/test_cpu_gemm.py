"""Prepacked CPU GEMMs give F.linear's results bit for bit, at any number of rows."""

import pytest
import torch
import torch.nn.functional as F

from engine.models.cpu_gemm import PackedWeight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weight_equals_f_linear_at_every_row_count(dtype, bias):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(960, 576, generator=generator).to(dtype)
    b = torch.randn(960, generator=generator).to(dtype) if bias else None
    packed = PackedWeight(weight, b)
    native = torch._C.has_mkl if dtype == torch.float32 else torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert (packed.packed is not None) == native
    for rows in (1, 2, 7, 64, 129):
        x = torch.randn(rows, 576, generator=generator).to(dtype)
        assert torch.equal(packed(x), F.linear(x, weight, b)), f"{dtype} rows={rows}"
