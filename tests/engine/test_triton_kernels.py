"""The Triton attention backend against the torch reference backend on random pools and ragged batches: decode
and (chunked) prefill together, GQA ratios, block sizes 1 to 64, contexts ending mid-block, blocks shared
between sequences (prefix-cache hits), head dims that need padding, float32, bf16 and fp16. On CPU under
Triton's interpreter; on CUDA (the GPU check runs this file there) with the compiled kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; only Triton reads it
import triton  # noqa: E402, F401  (in the dev extra: a missing triton fails here, never skips)

from engine.attention import triton_kernels as tk  # noqa: E402
from engine.attention.base import PrefillGroup, StepBatch  # noqa: E402
from engine.attention.torch_backend import TorchAttention  # noqa: E402
from engine.attention.triton_backend import TritonAttention  # noqa: E402
from engine.kernels import cpu_kernel  # noqa: E402
from tests.engine.triton_compile import HOPPER_SHARED_BYTES, hopper_shared_bytes  # noqa: E402

DEVICE = torch.device("cuda" if CUDA else "cpu")
ROOT = Path(__file__).resolve().parents[2]
REL_TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}  # of the output's largest value


@dataclass(frozen=True)
class Case:
    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    decode_lens: tuple[int, ...]  # context length of each decode sequence; its last position is the query
    prefills: tuple[tuple[int, int], ...]  # (query_len, context_len); context_len > query_len: prior context
    shared_blocks: int = 0  # leading blocks common to the sequences whose queries all lie after them
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        return self.name


CASES = [
    Case("bs1-gqa2", 4, 2, 16, 1, (1, 6), ((5, 5), (3, 9))),
    Case("bs4-gqa3-midblock", 6, 2, 16, 4, (5, 8, 13), ((6, 6), (5, 14))),
    Case("bs16-mha-hd32", 2, 2, 32, 16, (17, 33), ((20, 20), (16, 40))),
    Case("bs8-mqa8-chunked", 8, 1, 16, 8, (3,), ((19, 45), (2, 30))),
    Case("bs4-shared-prefix", 4, 2, 16, 4, (14, 19), ((4, 21), (9, 17)), shared_blocks=3),
    Case("bs8-hd24-padded", 4, 2, 24, 8, (9,), ((10, 19),)),
    Case("decode-only-bs32", 4, 1, 16, 32, (1, 31, 33, 70), ()),
    Case("prefill-only-bs2", 2, 1, 16, 2, (), ((9, 9), (1, 4), (7, 12))),
    Case("bf16-bs4", 6, 2, 16, 4, (7, 12), ((5, 10),), dtype=torch.bfloat16),
    Case("fp16-bs4", 6, 2, 16, 4, (7, 12), ((5, 10),), dtype=torch.float16),
    # real sizes: SmolLM2's heads, long contexts, many query tiles, big head dims (seconds each in the interpreter)
    Case("smollm2-heads-bs16", 9, 3, 64, 16, (1, 100, 1000, 2047), ((300, 300), (128, 1500), (1, 700))),
    Case("smollm2-heads-bf16", 9, 3, 64, 16, (100, 1000, 2047), ((300, 300), (128, 1500)), dtype=torch.bfloat16),
    Case("hd128-gqa4-bs32", 32, 8, 128, 32, (513, 64), ((96, 544), (77, 77)), shared_blocks=8),
    Case("hd256-gqa2-bs64-fp16", 8, 4, 256, 64, (129, 1000), ((200, 400),), dtype=torch.float16),
    Case("hd80-padded-bs8", 4, 2, 80, 8, (55, 240), ((33, 99),)),
]


def build_step(case: Case, generator: torch.Generator) -> tuple[StepBatch, int]:
    """A step with random, non-contiguous block tables; returns it and the pool's block count."""
    bs = case.block_size
    lens = list(case.decode_lens) + [ctx for _, ctx in case.prefills]
    first_queries = [n - 1 for n in case.decode_lens] + [ctx - q for q, ctx in case.prefills]
    shared = [min(case.shared_blocks, first // bs) for first in first_queries]
    num_blocks = 1 + case.shared_blocks + sum(-(-n // bs) - s for n, s in zip(lens, shared, strict=True)) + 3
    free = (torch.randperm(num_blocks - 1, generator=generator) + 1).tolist()  # block 0 is the null block
    common = [free.pop() for _ in range(case.shared_blocks)]
    tables = [common[:s] + [free.pop() for _ in range(-(-n // bs) - s)] for n, s in zip(lens, shared, strict=True)]
    slots = [t[p // bs] * bs + p % bs for t, n, first in zip(tables, lens, first_queries, strict=True)
             for p in range(first, n)]
    nd = len(case.decode_lens)
    prefill = None
    if case.prefills:
        prefill = PrefillGroup([q for q, _ in case.prefills], [c for _, c in case.prefills], padded(tables[nd:]))
    decode_tables = padded(tables[:nd]) if nd else padded([[0]])
    num_tokens = len(slots)
    batch = StepBatch(input_ids=torch.zeros(num_tokens, dtype=torch.long, device=DEVICE),
                      positions=torch.zeros(num_tokens, dtype=torch.long, device=DEVICE),
                      slot_mapping=torch.tensor(slots, device=DEVICE), num_decodes=nd,
                      decode_context_lens=torch.tensor(case.decode_lens, dtype=torch.long, device=DEVICE),
                      decode_block_tables=decode_tables, decode_max_context_len=max(case.decode_lens, default=0),
                      prefill=prefill, sample_indices=torch.arange(num_tokens, device=DEVICE))
    return batch, num_blocks


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(map(len, tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)


def random_pools(case: Case, num_blocks: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot random, also those past a context's end: the kernels must mask them."""
    shape = (case.num_kv_heads, num_blocks, case.block_size, case.head_dim)
    return (torch.randn(shape, generator=generator).to(DEVICE, case.dtype),
            torch.randn(shape, generator=generator).to(DEVICE, case.dtype))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def run_case(case: Case) -> None:
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    batch, num_blocks = build_step(case, generator)
    k_pool, v_pool = random_pools(case, num_blocks, generator)
    num_tokens, hq, hkv, d = batch.slot_mapping.shape[0], case.num_q_heads, case.num_kv_heads, case.head_dim
    qkv = torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=generator).to(DEVICE, case.dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)  # strided views, as the model passes them

    triton_backend = TritonAttention([k_pool.clone()], [v_pool.clone()], hq)
    triton_backend.begin_step(batch)
    out = triton_backend.forward(0, q, k, v)
    # the reference in float32 on the same (rounded) inputs
    reference = TorchAttention([k_pool.float()], [v_pool.float()], hq)
    reference.begin_step(batch)
    expected = reference.forward(0, q.float(), k.float(), v.float())

    assert out.dtype == case.dtype and out.shape == q.shape
    assert torch.equal(triton_backend.k_caches[0].float(), reference.k_caches[0])
    assert torch.equal(triton_backend.v_caches[0].float(), reference.v_caches[0])
    error = rel_error(out, expected)
    print(f"{case.name}: relative error {error:.1e}")
    assert error <= REL_TOL[case.dtype], f"{case.name}: relative error {error:.2e}"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_triton_backend_matches_torch_reference(case):
    run_case(case)


def test_write_kv_skips_padding_slots():
    k_pool = torch.zeros(2, 3, 4, 16, device=DEVICE)
    v_pool = torch.zeros_like(k_pool)
    k = torch.randn(3, 32, device=DEVICE)
    v = torch.randn(3, 32, device=DEVICE)
    tk.write_kv(k, v, k_pool, v_pool, torch.tensor([5, -1, 11], device=DEVICE))
    for pool, rows in ((k_pool, k), (v_pool, v)):
        flat = pool.view(2, 12, 16)
        assert torch.equal(flat[:, 5], rows[0].view(2, 16)) and torch.equal(flat[:, 11], rows[2].view(2, 16))
        assert flat.count_nonzero() == 2 * 2 * 16  # the -1 row wrote nothing


def test_decode_padding_rows_give_zeros():
    """Context length 0 (a padded CUDA-graph row): output zeros, no NaN, and the real row is unaffected."""
    k_pool = torch.randn(1, 4, 4, 16, device=DEVICE)
    v_pool = torch.randn(1, 4, 4, 16, device=DEVICE)
    q = torch.randn(2, 32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    tables = torch.tensor([[1, 2], [0, 0]], device=DEVICE)
    tk.paged_decode_attention(q, k_pool, v_pool, out, tables, torch.tensor([6, 0], device=DEVICE))
    assert torch.equal(out[1], torch.zeros(32, device=DEVICE))
    keys = k_pool[0, 1:3].reshape(8, 16)[:6]
    values = v_pool[0, 1:3].reshape(8, 16)[:6]
    expected = torch.softmax(q[0].view(2, 16) @ keys.T / 4.0, dim=-1) @ values
    assert rel_error(out[0].view(2, 16), expected) <= 1e-5


def test_backend_rejects_unsupported_shapes():
    pool = torch.zeros(2, 2, 4, 512, device=DEVICE)
    with pytest.raises(ValueError, match="head dims"):
        TritonAttention([pool], [pool], 4)
    pool = torch.zeros(2, 2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="not a multiple"):
        TritonAttention([pool], [pool], 3)


@pytest.mark.skipif(CUDA, reason="on CUDA the kernels are compiled and run by the tests above")
def test_kernels_compile_for_hopper_without_a_gpu():
    """What the interpreter does not check (types, tl.dot shapes, resources): compile for sm_90 with the launches'
    own parameters, in a fresh process without the interpreter."""
    shared = hopper_shared_bytes("engine.attention.triton_kernels",
                                 ["(torch.bfloat16, 9, 3, 64, 16)", "(torch.float32, 4, 2, 24, 1)",
                                  "(torch.float16, 8, 4, 256, 64)", "(torch.float32, 32, 8, 128, 32)"])
    assert len(shared) == 4 and max(shared) <= HOPPER_SHARED_BYTES, shared


@pytest.mark.skipif(CUDA, reason="checks the CPU-only error")
def test_clear_errors_without_interpreter_or_triton():
    """In fresh processes: on CPU without the interpreter, and without triton, choosing the backend says why."""
    script = ("import sys, torch\n"
              "if sys.argv[1] == 'no-triton': sys.modules['triton'] = None\n"
              "try:\n"
              "    from engine.attention.triton_backend import TritonAttention\n"
              "    pool = torch.zeros(1, 2, 4, 16)\n"
              "    TritonAttention([pool], [pool], 2)\n"
              "except (ImportError, RuntimeError) as error:\n"
              "    print(type(error).__name__, error)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for mode, expected in (("cpu", "RuntimeError the Triton backend runs on CPU tensors only in Triton's interpreter"),
                           ("no-triton", "ImportError attention_backend='triton' needs the `triton` package")):
        proc = subprocess.run([sys.executable, "-c", script, mode], env=env, cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.stdout.startswith(expected), proc.stdout + proc.stderr



def one_sequence_step(table: torch.Tensor, block_size: int, query_len: int, context_len: int) -> StepBatch:
    """A step of one sequence alone: the last `query_len` of its `context_len` positions, a decode when one."""
    positions = torch.arange(context_len - query_len, context_len, device=DEVICE)
    decode = query_len == 1
    return StepBatch(input_ids=torch.zeros(query_len, dtype=torch.long, device=DEVICE), positions=positions,
                     slot_mapping=table[positions // block_size] * block_size + positions % block_size,
                     num_decodes=int(decode), decode_context_lens=torch.tensor([context_len] * decode, device=DEVICE),
                     decode_block_tables=table[None] if decode else padded([[0]]),
                     decode_max_context_len=context_len if decode else 0,
                     prefill=None if decode else PrefillGroup([query_len], [context_len], table[None]),
                     sample_indices=torch.arange(query_len, device=DEVICE))


@pytest.mark.parametrize("backend", [TritonAttention, TorchAttention], ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_batch_invariant_mode_gives_a_query_the_same_output_alone_or_batched(backend, dtype):
    """Every query of a mixed step, and each prefill's last query as a decode of its own, bit-identical. Triton
    only on CUDA: the interpreter's tl.dot is numpy's matmul, whose rows depend on the other rows' values."""
    if backend is TorchAttention and (CUDA or not cpu_kernel.available(dtype)):
        pytest.skip("the torch backend's batch-invariant path is the CPU kernel")
    if backend is TritonAttention and not CUDA:
        pytest.skip("under Triton's interpreter a row of tl.dot depends on the other rows (numpy's matmul)")
    case = Case("invariant", 6, 2, 16, 4, (7, 12), ((5, 10), (3, 3), (2, 19)), dtype=dtype)
    generator = torch.Generator().manual_seed(5)
    batch, num_blocks = build_step(case, generator)
    seqs = [(1, n) for n in case.decode_lens] + list(case.prefills)  # (query_len, context_len)
    batch.positions = torch.cat([torch.arange(c - q, c) for q, c in seqs]).to(DEVICE)
    k_pool, v_pool = random_pools(case, num_blocks, generator)
    qkv = torch.randn(len(batch.positions), 10 * 16, generator=generator).to(DEVICE, dtype)
    q, k, v = qkv.split([6 * 16, 2 * 16, 2 * 16], dim=1)
    attention = backend([k_pool], [v_pool], 6)
    attention.set_batch_invariant(True)
    attention.begin_step(batch)
    batched = attention.forward(0, q, k, v)
    tables = list(batch.decode_block_tables[:batch.num_decodes]) + list(batch.prefill.block_tables)
    first = 0
    for table, (query_len, context_len) in zip(tables, seqs, strict=True):
        rows = slice(first, first + query_len)
        attention.begin_step(one_sequence_step(table, case.block_size, query_len, context_len))
        assert torch.equal(attention.forward(0, q[rows], k[rows], v[rows]), batched[rows])
        attention.begin_step(one_sequence_step(table, case.block_size, 1, context_len))  # its last query alone
        last = slice(rows.stop - 1, rows.stop)
        assert torch.equal(attention.forward(0, q[last], k[last], v[last]), batched[last])
        first += query_len
