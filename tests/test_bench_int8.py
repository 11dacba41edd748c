"""bench int8: the timed int8 paths compute the right product, and the bench runs on tiny shapes."""

import torch

from tokenmill.bench import int8


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def test_w8a8_dequantised_output_is_close_to_the_float_product():
    torch.manual_seed(0)
    weight = torch.randn(96, 128) * 0.05
    x = torch.randn(24, 128).to(torch.bfloat16)
    want = x.float() @ weight.t()
    w8a8 = int8.W8A8(weight, 24)
    with torch.inference_mode():
        by_int_mm = w8a8.int_mm(x)
        assert by_int_mm.dtype == torch.bfloat16 and by_int_mm.shape == (24, 96)
        assert _relative_error(by_int_mm, want) < 0.02
        # the GEMM alone is exact integer arithmetic
        qx, x_scale = int8.quantize_per_token(x)
        assert torch.equal(w8a8.int_mm_gemm(qx), qx.int() @ w8a8.qweight.int().t())
        if w8a8.qlinear_weight is not None:  # oneDNN's quantized linear, where this torch has it
            assert _relative_error(w8a8.qlinear(x), want) < 0.02
        dynamic, reason = int8.dynamic_linear(weight)
        if dynamic is not None:
            assert _relative_error(dynamic(x.float()), want) < 0.05, reason


def test_quantization_is_symmetric_per_token_and_per_channel():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [100.0, 1.0, -50.0]])
    qx, scale = int8.quantize_per_token(x)
    assert qx.dtype == torch.int8 and scale.shape == (3, 1)
    assert qx[0].tolist() == [64, -127, 32] and qx[1].tolist() == [0, 0, 0] and qx[2, 0] == 127
    qw, w_scale = int8.quantize_per_channel(x)
    assert torch.equal(qw, qx) and torch.allclose(w_scale, scale.squeeze(1))


def test_bench_runs_on_tiny_shapes_and_rates_are_positive():
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "intermediate_size": 96, "vocab_size": 128}
    shapes = int8.model_shapes(config)
    assert [(s.name, s.out_features, s.in_features, s.per_step) for s in shapes] == [
        ("qkv", 128, 64, 2), ("o", 64, 64, 2), ("gate_up", 192, 64, 2), ("down", 64, 96, 2), ("lm_head", 128, 64, 1)]
    timings = int8.measure(shapes, rows=(4, 8), repeats=2)
    assert len(timings) == 10
    for timing in timings:
        for path in (int8.ENGINE, int8.FLINEAR, int8.INT_MM, int8.TOTAL_INT_MM):
            assert timing.rate(path) > 0
    for paths in (int8.GEMMS, int8.TOTALS):
        ratios = int8.decode_ratios(timings, paths)
        assert set(ratios) == {4, 8, "overall"} and all(r > 0 for r in ratios.values())
    assert int8.conclusion(1.2).startswith("int8 does not pay here: 1.20x < 1.7x")
    assert int8.conclusion(1.8).startswith("int8 pays here")


def test_smollm2_shapes_are_the_ones_the_engine_runs():
    config = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152}
    assert [(s.out_features, s.in_features) for s in int8.model_shapes(config)] == [
        (960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
