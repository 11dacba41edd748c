"""`tokenmill bench roofline`: the floor's arithmetic on hand-made steps, and a tiny run of the command on the real
model that prints every part of the floor, per phase, with the run's share of it."""

from __future__ import annotations

import json
import re

import pytest

from tokenmill.bench.roofline import Roofline, StepRecord, phase_floors, stream_bandwidth
from tokenmill.cli import main

NUMBER = r"([\d,.e+-]+)"

# round numbers: 100 FLOPs a token through the layers, 10 through the head; 1,000 + 100 weight bytes; 10 KV bytes a
# token; 1,000 FLOP/s and 10,000 B/s
ROOF = Roofline(layer_flops_per_token=100, head_flops_per_token=10, layer_weight_bytes=1000, head_weight_bytes=100,
                kv_bytes_per_token=10, peak_flops=1000, bandwidth=10_000)


def test_each_step_is_held_to_the_larger_of_its_compute_and_memory_time():
    steps = [
        StepRecord(50, 0, 2, 50, seconds=10.0),  # a prompt: (5,000 + 20) / 1,000 = 5.02 s of GEMMs, compute-bound
        StepRecord(0, 4, 4, 400, seconds=1.0),  # 0.44 s of GEMMs < 0.11 + 0.40 s of reads: memory-bound
        StepRecord(0, 8, 8, 8, seconds=2.0),  # 0.88 s of GEMMs > 0.11 + 0.008 s: compute-bound
        StepRecord(10, 2, 3, 200, seconds=2.0),  # prompt and decode rows together count as prefill: 1.23 s
        StepRecord(20, 0, 0, 20, seconds=4.0),  # a chunk that samples nothing reads no LM head: 2.0 s against 0.12 s
    ]
    assert ROOF.parts(steps[1]) == pytest.approx((0.44, 0.11, 0.40))
    assert ROOF.parts(steps[4]) == pytest.approx((2.0, 0.1, 0.02))
    assert [ROOF.floor(s) for s in steps] == pytest.approx([5.02, 0.51, 0.88, 1.23, 2.0])
    prefill, decode, total = phase_floors(steps, ROOF, wall_seconds=20.0)
    assert (prefill.phase, prefill.steps, prefill.tokens) == ("prefill", 3, 82)
    assert (prefill.gemm_s, prefill.weights_s, prefill.kv_s) == pytest.approx((8.25, 0.32, 0.27))
    assert (prefill.floor_s, prefill.measured_s, prefill.share) == pytest.approx((8.25, 16.0, 8.25 / 16))
    assert (decode.phase, decode.steps, decode.tokens) == ("decode", 2, 12)
    assert (decode.gemm_s, decode.weights_s, decode.kv_s) == pytest.approx((1.32, 0.22, 0.408))
    # summed step by step: 0.51 + 0.88, above the larger of the summed sides (1.32 of GEMMs)
    assert (decode.floor_s, decode.measured_s) == pytest.approx((1.39, 3.0))
    assert (total.phase, total.steps, total.tokens) == ("total", 5, 94)
    assert total.floor_s == pytest.approx(9.64) and total.measured_s == 20.0
    assert total.share == pytest.approx(9.64 / 20)
    assert phase_floors(steps, ROOF)[2].measured_s == pytest.approx(19.0)  # without the wall time: the steps'


def test_limits_a_step_of_the_run_beat_are_raised_to_it():
    """A limit measured on a busy machine comes out low: a step faster than the floor raises it to that step's
    rate, so no phase lies under its floor."""
    fast_gemm = StepRecord(50, 0, 2, 50, seconds=2.51)  # 5,020 FLOPs in 2.51 s: 2,000 FLOP/s, twice the limit
    fast_read = StepRecord(0, 4, 4, 400, seconds=0.2)  # 0.44 s of GEMMs, 5,100 bytes in 0.2 s: 25,500 B/s
    slow = StepRecord(0, 8, 8, 8, seconds=2.0)
    roof, raised = ROOF.raised_to([fast_gemm, fast_read, slow])
    assert (roof.peak_flops, roof.bandwidth) == pytest.approx((2200, 25_500))  # fast_read's 440 FLOPs in 0.2 s
    assert len(raised) == 2 and "GEMM peak raised to" in raised[0] and "bandwidth raised to" in raised[1]
    assert all(roof.floor(s) <= s.seconds * 1.000001 for s in (fast_gemm, fast_read, slow))
    assert ROOF.raised_to([slow]) == (ROOF, [])  # a run under both limits leaves them as measured


def test_stream_counts_its_bytes_as_stream_does():
    stream = stream_bandwidth(8 << 20, repeats=2)
    assert stream.array_bytes == 8 << 20
    assert set(stream.rates) == {"copy", "scale", "add", "triad"}
    assert all(rate > 0 for rate in stream.rates.values()) and stream.best == max(stream.rates.values())


@pytest.mark.real_model
def test_bench_roofline_prints_the_floor_per_phase(tmp_path, capsys):
    out = tmp_path / "roofline.json"
    code = main(["bench", "roofline", "--num-prompts", "3", "--min-tokens", "4", "--max-tokens", "6",
                 "--peak-rows", "16", "--stream-mib", "64", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert re.search(r"machine: .*flags: .*avx", printed), printed
    assert re.search(r"stream bandwidth: [\d.]+ GB/s \(the best of STREAM's copy [\d.]+, scale [\d.]+, add [\d.]+, "
                     r"triad [\d.]+ GB/s", printed), printed
    assert re.search(r"GEMM peak: [\d.]+ GFLOP/s", printed), printed
    for header in ("GEMM s at peak", "weights-read s", "KV-read s", "floor s", "measured s", "% of floor"):
        assert header in printed
    for phase in ("prefill", "decode", "total"):
        row = re.search(rf"│ {phase}\s*│" + r"\s*│".join([rf"\s*{NUMBER}"] * 7) + rf"\s*│\s*{NUMBER}%", printed)
        assert row, printed
        steps, tokens, gemm, weights, kv, floor, measured, share = (float(v.replace(",", "")) for v in row.groups())
        assert min(steps, tokens, gemm, weights, kv, floor, measured) > 0, row.group(0)
        assert max(gemm, weights + kv) * 0.999 <= floor <= (gemm + weights + kv) * 1.001, row.group(0)
        assert 0 < share <= 100, row.group(0)  # 100: a step of the run set the limit (`Roofline.raised_to`)
    report = json.loads(out.read_text())
    assert report["roofline"]["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # SmolLM2-135M's, float32
    steps = [StepRecord(**s) for s in report["steps"]]
    assert sum(s.sampled for s in steps) == report["output_tokens"]  # one row sampled per output token
    assert all(s.seconds > 0 for s in steps)
    phases = {p["phase"]: p for p in report["phases"]}
    for key in ("steps", "tokens", "gemm_s", "weights_s", "kv_s", "floor_s"):
        assert phases["total"][key] == pytest.approx(phases["prefill"][key] + phases["decode"][key])
    assert phases["total"]["measured_s"] == report["wall_seconds"]
    assert phases["total"]["measured_s"] >= phases["prefill"]["measured_s"] + phases["decode"]["measured_s"]
