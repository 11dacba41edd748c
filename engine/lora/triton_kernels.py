"""Triton kernels of the gathered LoRA product (engine/lora/kernels.py), SGMV-style: the rows grouped by slot
(`segments`, on the device, without synchronizing), then two kernels over (row tile, slot) programs:

- shrink: h [T, R] = x[rows] @ lora_a[s].T, float32, a tile of one slot's rows by a block of ranks, over `in`;
- expand: out[rows] += h @ lora_b[s], a tile of rows by a tile of output columns, out's value plus the float32
  product rounded to its dtype once.

The grid covers every slot's largest possible row count (all T rows); a program past its slot's rows returns at
once, so the launch needs no row counts on the host. Products are exact float32 (`input_precision="ieee"`, no TF32).

Without a GPU the kernels run in Triton's interpreter on CPU tensors: `TRITON_INTERPRET=1` must be set before this
module is imported (Triton reads it when the kernels are decorated)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.lora.grouping import segments

BLOCK_ROWS = 16  # rows per program (tl.dot's smallest tile)
BLOCK_IN = 64  # input features per shrink step
BLOCK_OUT = 64  # output columns per expand program
MIN_RANKS = 16  # tl.dot's smallest inner size: ranks are padded to a power of two at least this


@triton.jit
def _slot_rows(order_ptr, start_ptr, slot, count, tile, BLOCK_ROWS: tl.constexpr):
    """A program's rows of one slot: their positions in `order`, which are real, and the batch rows."""
    positions = tl.load(start_ptr + slot) + tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_mask = tile * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS) < count
    rows = tl.load(order_ptr + positions, mask=row_mask, other=0).to(tl.int64)
    return positions, row_mask, rows


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, order_ptr, start_ptr, count_ptr, stride_x, in_features, rank,
                   BLOCK_ROWS: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_IN: tl.constexpr):
    tile, slot = tl.program_id(0), tl.program_id(1)
    count = tl.load(count_ptr + slot)
    if tile * BLOCK_ROWS >= count:
        return
    positions, row_mask, rows = _slot_rows(order_ptr, start_ptr, slot, count, tile, BLOCK_ROWS)
    ranks = tl.program_id(2) * BLOCK_RANK + tl.arange(0, BLOCK_RANK)
    rank_mask = ranks < rank
    a_rows = a_ptr + slot.to(tl.int64) * rank * in_features + ranks.to(tl.int64) * in_features
    sums = tl.zeros((BLOCK_ROWS, BLOCK_RANK), dtype=tl.float32)
    for first in range(0, in_features, BLOCK_IN):
        features = first + tl.arange(0, BLOCK_IN)
        feature_mask = features < in_features
        x = tl.load(x_ptr + rows[:, None] * stride_x + features[None, :],
                    mask=row_mask[:, None] & feature_mask[None, :], other=0.0).to(tl.float32)
        a = tl.load(a_rows[None, :] + features[:, None], mask=feature_mask[:, None] & rank_mask[None, :], other=0.0)
        sums += tl.dot(x, a, input_precision="ieee")
    tl.store(h_ptr + positions.to(tl.int64)[:, None] * rank + ranks[None, :], sums,
             mask=row_mask[:, None] & rank_mask[None, :])


@triton.jit
def _round_bf16(x):
    """float32 -> bfloat16 to nearest even, as torch rounds (the interpreter's own cast truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, out_ptr, order_ptr, start_ptr, count_ptr, stride_out, out_features, rank,
                   BLOCK_ROWS: tl.constexpr, BLOCK_RANK: tl.constexpr, BLOCK_OUT: tl.constexpr):
    tile, slot = tl.program_id(0), tl.program_id(2)
    count = tl.load(count_ptr + slot)
    if tile * BLOCK_ROWS >= count:
        return
    positions, row_mask, rows = _slot_rows(order_ptr, start_ptr, slot, count, tile, BLOCK_ROWS)
    columns = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    column_mask = columns < out_features
    b_slot = b_ptr + slot.to(tl.int64) * rank * out_features
    sums = tl.zeros((BLOCK_ROWS, BLOCK_OUT), dtype=tl.float32)
    for first in range(0, rank, BLOCK_RANK):
        ranks = first + tl.arange(0, BLOCK_RANK)
        rank_mask = ranks < rank
        h = tl.load(h_ptr + positions.to(tl.int64)[:, None] * rank + ranks[None, :],
                    mask=row_mask[:, None] & rank_mask[None, :], other=0.0)
        b = tl.load(b_slot + ranks.to(tl.int64)[:, None] * out_features + columns[None, :],
                    mask=rank_mask[:, None] & column_mask[None, :], other=0.0)
        sums += tl.dot(h, b, input_precision="ieee")
    mask = row_mask[:, None] & column_mask[None, :]
    pointers = out_ptr + rows[:, None] * stride_out + columns[None, :]
    total = tl.load(pointers, mask=mask, other=0.0).to(tl.float32) + sums
    if out_ptr.dtype.element_ty == tl.bfloat16:
        tl.store(pointers, _round_bf16(total), mask=mask)
    else:
        tl.store(pointers, total.to(out_ptr.dtype.element_ty), mask=mask)


def rank_block(rank: int) -> int:
    """Ranks per shrink program and per expand step: a power of two, 16 to 64."""
    return min(max(triton.next_power_of_2(rank), MIN_RANKS), 64)


def lora_triton(x: torch.Tensor, out: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
                grouped: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """out[t] += (x[t] @ lora_a[s].T) @ lora_b[s] in place for s = slots[t] >= 0 (the contract of
    engine/lora/kernels.py); `grouped`: `segments(slots, S)` when the caller already has it (one per step)."""
    num_rows = x.shape[0]
    num_slots, rank, in_features = lora_a.shape
    out_features = out.shape[1]
    if num_rows == 0 or rank == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    if out.stride(1) != 1:
        raise ValueError("lora_triton: out's rows must be contiguous")
    lora_a, lora_b = lora_a.contiguous(), lora_b.contiguous()
    order, starts, counts = grouped if grouped is not None else segments(slots, num_slots)
    h = torch.empty((num_rows, rank), dtype=torch.float32, device=x.device)  # row i: the i-th row of `order`
    tiles = triton.cdiv(num_rows, BLOCK_ROWS)
    block_rank = rank_block(rank)
    _shrink_kernel[(tiles, num_slots, triton.cdiv(rank, block_rank))](
        x, lora_a, h, order, starts, counts, x.stride(0), in_features, rank,
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_RANK=block_rank, BLOCK_IN=BLOCK_IN)
    _expand_kernel[(tiles, triton.cdiv(out_features, BLOCK_OUT), num_slots)](
        h, lora_b, out, order, starts, counts, out.stride(0), out_features, rank,
        BLOCK_ROWS=BLOCK_ROWS, BLOCK_RANK=block_rank, BLOCK_OUT=BLOCK_OUT)


def compile_for(capability: int, dtype: torch.dtype, rank: int) -> dict[str, int]:
    """Compile both kernels, with the launches' own parameters, for CUDA compute capability `capability` (90: H100,
    H200) without a GPU: Triton's front end and bundled ptxas. Returns each kernel's shared memory in bytes."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ptr = "*" + {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    common = dict(order_ptr="*i64", start_ptr="*i64", count_ptr="*i64", rank="i32")
    kernels = {
        "shrink": (_shrink_kernel, dict(BLOCK_ROWS=BLOCK_ROWS, BLOCK_RANK=rank_block(rank), BLOCK_IN=BLOCK_IN),
                   dict(common, x_ptr=ptr, a_ptr="*fp32", h_ptr="*fp32", stride_x="i32", in_features="i32")),
        "expand": (_expand_kernel, dict(BLOCK_ROWS=BLOCK_ROWS, BLOCK_RANK=rank_block(rank), BLOCK_OUT=BLOCK_OUT),
                   dict(common, h_ptr="*fp32", b_ptr="*fp32", out_ptr=ptr, stride_out="i32", out_features="i32")),
    }
    target = GPUTarget("cuda", capability, 32)
    shared = {}
    for name, (kernel, meta, arg_types) in kernels.items():
        signature = {arg: arg_types.get(arg, "constexpr") for arg in kernel.arg_names}
        shared[name] = triton.compile(ASTSource(kernel, signature, meta), target=target).metadata.shared
    return shared
