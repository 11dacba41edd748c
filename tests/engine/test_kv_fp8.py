"""FP8 KV cache (kv_cache_dtype="fp8"): e4m3 quantisation (round trip, saturation, the C writer's bytes equal
torch's), the C decode kernel and the torch backend's gathering paths on FP8 blocks against a float32 reference,
the Triton kernels under the interpreter, the memory plan's block count, given scales, batch invariance within the
dtype, and the real model's greedy output against the model-dtype cache."""

from __future__ import annotations

import os
import zlib

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (as test_triton_kernels)

from engine import LLM, SamplingParams  # noqa: E402
from engine.attention.base import allocate_kv_pool, zero_blocks  # noqa: E402
from engine.attention.torch_backend import TorchAttention  # noqa: E402
from engine.kernels import cpu_kernel  # noqa: E402
from engine.kv_quant import FP8_DTYPE, FP8_MAX, KVScales, dequantize, quantize, save_scales  # noqa: E402
from tests.engine.test_triton_kernels import DEVICE, Case, build_step, rel_error  # noqa: E402
from tests.engine.triton_compile import HOPPER_SHARED_BYTES, hopper_shared_bytes  # noqa: E402
from tokenmill.bench.tiny_model import save_random_model  # noqa: E402

ALL_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE)
FINITE = ALL_BYTES[~ALL_BYTES.float().isnan()]


def test_every_e4m3_value_survives_a_round_trip_and_the_rest_saturate():
    scale = torch.tensor([0.5, 3.0])
    values = FINITE.float()
    for head in range(2):
        x = (values * scale[head])[:, None, None].expand(-1, 2, 1).contiguous()  # [N, Hkv, 1]
        stored = quantize(x, scale)
        assert torch.equal(stored[:, head, 0].view(torch.uint8), FINITE.view(torch.uint8))
        assert torch.equal(dequantize(stored[:, head].T.contiguous(), scale[head:head + 1], torch.float32)[0],
                           values * scale[head])
    huge = torch.tensor([1e6, -1e6, 449.0, -460.0, float("inf")]).view(-1, 1, 1)
    assert torch.equal(quantize(huge, torch.ones(1)).float().flatten(), torch.tensor([448.0, -448, 448, -448, 448]))


def test_quantisation_error_is_within_e4m3_precision():
    x = torch.randn(4000, 3, 8, generator=torch.Generator().manual_seed(0)) * torch.tensor([0.01, 1.0, 30.0])[:, None]
    scale = x.abs().amax(dim=(0, 2)) * 2 / FP8_MAX
    back = dequantize(quantize(x, scale).transpose(0, 1), scale, torch.float32).transpose(0, 1)
    normal = x.abs() >= scale[:, None] * 2 ** -6
    assert ((back - x).abs() <= x.abs() * 2 ** -4)[normal].all()  # 3 mantissa bits: half an ulp is 1/16
    assert ((back - x).abs() <= scale[:, None] * 2 ** -10)[~normal].all()  # subnormals: half of 2^-9 x scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_writer_stores_torchs_bytes(dtype):
    tokens, hkv, d, slots = 70, 3, 64, 8 * 16  # >= 64 tokens: the writer's threads split them
    generator = torch.Generator().manual_seed(1)
    k = (torch.randn(tokens, hkv * d, generator=generator) * torch.logspace(-4, 3, tokens)[:, None]).to(dtype)
    v = (torch.randn(tokens, hkv * d, generator=generator) * 5).to(dtype)
    k_scale, v_scale = torch.tensor([0.01, 0.5, 2.0]), torch.tensor([0.02, 0.03, 1.0])
    k_pool = torch.zeros(hkv, 8, 16, d, dtype=FP8_DTYPE)
    v_pool = torch.zeros_like(k_pool)
    where = torch.randperm(slots, generator=generator)[:tokens]
    cpu_kernel.write_kv(k, v, k_pool, v_pool, where, k_scale, v_scale)
    for pool, x, scale in ((k_pool, k, k_scale), (v_pool, v, v_scale)):
        stored = pool.view(hkv, slots, d)[:, where].transpose(0, 1)
        expected = quantize(x.view(tokens, hkv, d), scale)
        assert torch.equal(stored.view(torch.uint8), expected.view(torch.uint8))


def fp8_pools(hkv: int, blocks: int, bs: int, d: int, generator: torch.Generator):
    """Random K and V FP8 pools with per-head scales, and the same values dequantised to float32."""
    k_scale = torch.rand(hkv, generator=generator) * 0.05 + 0.01
    v_scale = torch.rand(hkv, generator=generator) * 0.05 + 0.01
    pools, exact = [], []
    for scale in (k_scale, v_scale):
        x = torch.randn(blocks * bs, hkv, d, generator=generator) * scale[:, None] * 60
        stored = quantize(x, scale).transpose(0, 1).reshape(hkv, blocks, bs, d).contiguous()
        pools.append(stored)
        exact.append(dequantize(stored, scale, torch.float32))
    return pools, exact, (k_scale, v_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 16, 256, 24])  # vector widths (256: Gemma 3), the scalar kernel
def test_the_c_decode_kernel_reads_fp8_blocks_as_the_float32_reference(dtype, head_dim):
    hkv, group, bs, blocks, seqs = 3, 3, 16, 64, 12
    generator = torch.Generator().manual_seed(head_dim)
    (k_pool, v_pool), (k_exact, v_exact), (k_scale, v_scale) = fp8_pools(hkv, blocks, bs, head_dim, generator)
    q = torch.randn(seqs, hkv * group * head_dim, generator=generator).to(dtype)
    tables = torch.stack([torch.randperm(blocks - 1, generator=generator)[:12] + 1 for _ in range(seqs)]).int()
    lens = torch.randint(1, 12 * bs, (seqs,), generator=generator).int()
    out, _ = cpu_kernel.paged_decode(q, k_pool, v_pool, tables, lens, k_scale=k_scale, v_scale=v_scale)
    expected, _ = cpu_kernel.paged_decode(q.float(), k_exact, v_exact, tables, lens)
    assert out.dtype == dtype
    assert rel_error(out, expected) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("head_dim", [64, 16, 24])
def test_the_c_decode_kernel_widens_every_e4m3_byte_exactly(head_dim):
    """Context 1: the output is the value row times its scale, exactly; the rows hold every finite byte."""
    values = FINITE.view(torch.uint8).repeat(-(-FINITE.numel() // head_dim * head_dim) // FINITE.numel() + 1)
    rows = values[:-(-FINITE.numel() // head_dim) * head_dim].view(-1, head_dim).view(FP8_DTYPE)
    seqs, scale = rows.shape[0], torch.tensor([0.75])
    v_pool = rows.view(1, seqs, 1, head_dim).contiguous()
    k_pool = torch.zeros_like(v_pool)
    tables = torch.arange(seqs, dtype=torch.int32).view(seqs, 1)
    q = torch.randn(seqs, head_dim)
    out, _ = cpu_kernel.paged_decode(q, k_pool, v_pool, tables, torch.ones(seqs, dtype=torch.int32), k_scale=scale,
                                     v_scale=scale)
    assert torch.equal(out.view(seqs, head_dim), rows.float() * 0.75)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])  # key tiles widened to float32; to bfloat16 for bf16 queries (64)
def test_the_c_decode_kernel_widens_every_e4m3_key_byte_exactly(dtype, head_dim):
    """Context 1 and a one-hot query of sqrt(head_dim): each row's log-sum-exp is its one score, the key byte times
    its scale, exactly (powers of two throughout); one sequence per finite byte, its whole key row that byte."""
    seqs, scale = FINITE.numel(), torch.tensor([0.25])
    k_pool = FINITE.view(1, seqs, 1, 1).expand(1, seqs, 1, head_dim).contiguous()
    q = torch.zeros(seqs, head_dim)
    q[:, 3] = head_dim ** 0.5
    tables = torch.arange(seqs, dtype=torch.int32).view(seqs, 1)
    _, lse = cpu_kernel.paged_decode(q.to(dtype), k_pool, torch.zeros_like(k_pool), tables,
                                     torch.ones(seqs, dtype=torch.int32), with_lse=True, k_scale=scale, v_scale=scale)
    assert torch.equal(lse.view(seqs), FINITE.float() * 0.25)


CASES = [Case("fp8-mixed-shared-prefix", 6, 2, 64, 4, (14, 19, 30), ((4, 21), (9, 17)), shared_blocks=3),
         Case("fp8-hd24-bs8", 4, 2, 24, 8, (9, 40), ((10, 19), (7, 7)))]


def run_fp8_step(backend_class, case: Case, dtype: torch.dtype):
    """One step of `case` through a backend over FP8 pools and through a float32 reference over the same values
    dequantised; returns (output, reference output, the backend's pools, the scales)."""
    generator = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    batch, num_blocks = build_step(case, generator)
    hq, hkv, d = case.num_q_heads, case.num_kv_heads, case.head_dim
    (k_pool, v_pool), (k_exact, v_exact), (k_scale, v_scale) = fp8_pools(hkv, num_blocks, case.block_size, d,
                                                                        generator)
    scales = KVScales(k_scale[None], v_scale[None])
    k_pools, v_pools = allocate_kv_pool(1, hkv, num_blocks, case.block_size, d, dtype, DEVICE, scales)
    k_pools[0].copy_(k_pool)
    v_pools[0].copy_(v_pool)
    num_tokens = batch.slot_mapping.shape[0]
    qkv = (torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=generator) * 0.5).to(DEVICE, dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    backend = backend_class(k_pools, v_pools, hq)
    backend.begin_step(batch)
    out = backend.forward(0, q, k, v)
    # the reference: the step's keys and values as the FP8 pool stores them, attended in float32
    k_rounded = dequantize(quantize(k.float().view(num_tokens, hkv, d), k_scale).transpose(0, 1), k_scale,
                           torch.float32).transpose(0, 1).reshape(num_tokens, -1)
    v_rounded = dequantize(quantize(v.float().view(num_tokens, hkv, d), v_scale).transpose(0, 1), v_scale,
                           torch.float32).transpose(0, 1).reshape(num_tokens, -1)
    reference = TorchAttention([k_exact.to(DEVICE)], [v_exact.to(DEVICE)], hq)
    reference.begin_step(batch)
    expected = reference.forward(0, q.float(), k_rounded.to(DEVICE), v_rounded.to(DEVICE))
    return out, expected, (k_pools[0], v_pools[0]), (k_scale, v_scale), reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", ["1", "0"])  # the C decode kernel and writer, or torch's gather and index_copy_
@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_torch_backend_on_fp8_pools_matches_the_float32_reference(case, kernel, dtype, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_ATTENTION_KERNEL", kernel)
    out, expected, (k_pool, v_pool), (k_scale, v_scale), reference = run_fp8_step(TorchAttention, case, dtype)
    assert out.dtype == dtype and k_pool.dtype == FP8_DTYPE
    assert torch.equal(dequantize(k_pool, k_scale, torch.float32), reference.k_caches[0])  # written as torch does
    assert torch.equal(dequantize(v_pool, v_scale, torch.float32), reference.v_caches[0])
    assert rel_error(out, expected) <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_kernels_on_fp8_pools_match_the_float32_reference(dtype):
    from engine.attention.triton_backend import TritonAttention

    out, expected, (k_pool, v_pool), (k_scale, v_scale), reference = run_fp8_step(TritonAttention, CASES[0], dtype)
    assert torch.equal(dequantize(k_pool, k_scale.to(DEVICE), torch.float32), reference.k_caches[0])
    assert torch.equal(dequantize(v_pool, v_scale.to(DEVICE), torch.float32), reference.v_caches[0])
    assert rel_error(out, expected) <= (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.skipif(CUDA, reason="on CUDA the kernels are compiled and run by the test above")
def test_fp8_kernels_compile_for_hopper_without_a_gpu():
    shared = hopper_shared_bytes("engine.attention.triton_kernels",
                                 ["(torch.bfloat16, 9, 3, 64, 16, True)", "(torch.float16, 32, 8, 128, 32, True)"])
    assert len(shared) == 2 and max(shared) <= HOPPER_SHARED_BYTES, shared


def test_fp8_pools_zero_and_copy_blocks():
    k, _ = allocate_kv_pool(1, 2, 4, 2, 8, torch.float32, torch.device("cpu"),
                            KVScales(torch.ones(1, 2), torch.ones(1, 2)))
    pool = k[0]
    pool.view(torch.uint8).fill_(0x38)  # 1.0
    zero_blocks(k, 1, 2)
    pool[:, torch.tensor([3])] = pool[:, torch.tensor([1])]  # copy-on-write, as the runner copies blocks
    assert pool[:, 1].float().abs().sum() == 0 and pool[:, 3].float().abs().sum() == 0
    assert torch.equal(pool[:, 0].float(), torch.ones(2, 2, 8))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-fp8")
    save_random_model(path)
    return path


def test_the_memory_plan_fits_twice_the_blocks_and_logs_it(tiny_dir, caplog):
    settings = dict(dtype="bfloat16", num_threads=2, max_model_len=512, max_num_seqs=256, kv_cache_memory=1 << 20)
    with caplog.at_level("INFO", logger="tokenmill.engine"):
        fp8 = LLM(str(tiny_dir), kv_cache_dtype="fp8", **settings).engine.runner
    model_dtype = LLM(str(tiny_dir), **settings).engine.runner
    assert fp8.num_blocks >= 1.9 * model_dtype.num_blocks
    assert fp8.kv_plan.bytes_per_block * 2 == model_dtype.kv_plan.bytes_per_block
    pool = fp8.attention.k_caches + fp8.attention.v_caches
    assert all(t.dtype == FP8_DTYPE for t in pool)
    assert sum(t.nbytes for t in pool) == fp8.num_blocks * fp8.kv_plan.bytes_per_block <= 1 << 20
    assert any("2.00x the blocks in the same memory" in r.getMessage() for r in caplog.records)
    assert any("scales calibrated" in r.getMessage() for r in caplog.records)


def test_given_scales_are_used_as_given(tiny_dir, tmp_path):
    prompts = ["hello there, how are you", "the weather today is"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    calibrated = LLM(str(tiny_dir), kv_cache_dtype="fp8", num_threads=2, max_model_len=256)
    scales = calibrated.engine.runner.kv_plan.kv_scales
    save_scales(scales, tmp_path / "scales.json")
    given = LLM(str(tiny_dir), kv_cache_dtype="fp8_e4m3", kv_cache_scales=str(tmp_path / "scales.json"),
                num_threads=2, max_model_len=256)
    assert torch.equal(given.engine.runner.attention.k_scales.cpu(), scales.k)
    tokens = [o.outputs[0].token_ids for o in calibrated.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in given.generate(prompts, params)] == tokens
    coarse = LLM(str(tiny_dir), kv_cache_dtype="fp8", kv_cache_scales={"k": 1.0, "v": [1.0, 1.0]}, num_threads=2,
                 max_model_len=256)
    assert torch.equal(coarse.engine.runner.attention.v_scales.cpu(), torch.ones(2, 2))
    with pytest.raises(ValueError, match="shape"):
        LLM(str(tiny_dir), kv_cache_dtype="fp8", kv_cache_scales={"k": [1.0] * 3, "v": 1.0})
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(tiny_dir), kv_cache_dtype="int8")


PROMPTS = ["The three primary colors are", "Write a short poem about the sea:", "def quicksort(arr):",
           "The capital of France is", "Explain photosynthesis in one sentence.",
           "Once upon a time, in a small village,", "List three uses of a paperclip:",
           "The best way to learn a new language is"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariance_holds_within_fp8(model_dir, dtype):
    llm = LLM(str(model_dir), dtype=dtype, kv_cache_dtype="fp8", batch_invariant=True, num_threads=2,
              max_model_len=256, kv_cache_memory=32 << 20)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)

    def run(prompts, salt):
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params, cache_salt=salt)]

    alone = run([PROMPTS[0]], "alone")[0]
    assert run(PROMPTS[1:5] + [PROMPTS[0]] + PROMPTS[5:], "batched")[4] == alone


def test_the_real_model_keeps_most_greedy_tokens_with_an_fp8_cache(model_dir):
    """Teacher-forced: every position of the full-precision cache's 16 greedy tokens, its context fixed to those
    tokens, is a prompt of its own; the FP8 cache (which prefill reads back too) must pick the same next token at
    nearly all of them. Free-running agreement is no measure here: one near-tie flipped by the CPU's float32
    rounding sends the rest of a sequence elsewhere (it swung between 3/8 and 5/8 across CPU kinds)."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kwargs = dict(dtype="float32", num_threads=2, max_model_len=256, kv_cache_memory=32 << 20)
    full = LLM(str(model_dir), kv_cache_dtype="auto", **kwargs)
    tokenizer = full.get_tokenizer()
    greedy = [o.outputs[0].token_ids for o in full.generate(PROMPTS, params)]
    contexts = [tokenizer.encode(prompt) + tokens[:i] for prompt, tokens in zip(PROMPTS, greedy, strict=True)
                for i in range(len(tokens))]
    one = SamplingParams(max_tokens=1, temperature=0, logprobs=0)
    fp8 = LLM(str(model_dir), kv_cache_dtype="fp8", **kwargs)
    attention = fp8.engine.runner.attention
    assert all(t.dtype == FP8_DTYPE for t in attention.k_caches + attention.v_caches)
    picks, logprobs = {}, {}
    for name, llm in (("auto", full), ("fp8", fp8)):
        completions = [o.outputs[0] for o in llm.generate(contexts, one)]
        picks[name] = [c.token_ids[0] for c in completions]
        logprobs[name] = [c.logprobs[0][c.token_ids[0]].logprob for c in completions]
    first_tokens = picks["fp8"][::16] == [tokens[0] for tokens in greedy]
    same = sum(a == b for a, b in zip(picks["auto"], picks["fp8"], strict=True))
    print(f"fp8 keeps {same}/{len(contexts)} teacher-forced greedy tokens")
    assert first_tokens and same >= 0.9 * len(contexts), (same, len(contexts))
    moved = sum(abs(a - b) > 1e-6 for a, b in zip(logprobs["auto"], logprobs["fp8"], strict=True))
    assert moved >= len(contexts) // 2, f"the FP8 cache changed only {moved} logprobs: is it in use?"
