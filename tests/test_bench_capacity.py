"""bench capacity: the arithmetic on a tiny case by hand, and the default scenario's 10x."""

import subprocess
import sys

from tokenmill.bench.capacity import bytes_per_token, compare, pareto_lengths


def test_tiny_case_matches_a_hand_computation():
    # 1000 tokens of KV, 256-token context, 16-token blocks, requests of 10, 20 and 100 tokens in turn.
    contiguous, paged = compare(1000, 256, 16, [10, 20, 100])
    # contiguous: 1000 // 256 = 3 reservations -> the first three requests, 768 slots reserved
    assert (contiguous.requests, contiguous.used_tokens, contiguous.reserved_tokens) == (3, 130, 768)
    assert contiguous.wasted_tokens == 638
    # paged: 62 blocks; a cycle of the three takes 1 + 2 + 7 = 10 blocks -> 6 cycles (60 blocks), then the
    # 10-token request (61 blocks); the 20-token one would need 63
    assert (paged.requests, paged.used_tokens, paged.reserved_tokens) == (19, 790, 61 * 16)
    assert paged.wasted_tokens == 186 and paged.waste_per_request < 16


def test_llama3_8b_kv_bytes_and_pareto_mean():
    assert bytes_per_token("llama-3-8b") == 131_072
    lengths = pareto_lengths(20_000, 150, 4096, seed=1)
    assert max(lengths) <= 4096 and 130 < sum(lengths) / len(lengths) < 160


def test_default_scenario_fits_ten_times_more_requests_paged():
    proc = subprocess.run([sys.executable, "-m", "tokenmill", "bench", "capacity"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    ratio = float(proc.stdout.split("paged fits ")[1].split("x")[0])
    assert ratio >= 10
    assert "under one 16-token block" in proc.stdout
