"""The gathered LoRA product (engine/lora/kernels.py) against an exact float64 product: the C kernel
(csrc/lora.c, as built here and built for AVX2 alone) and the Triton kernels (under Triton's interpreter on CPU,
compiled on CUDA), float32 within float32 rounding, bfloat16 within one bfloat16 ulp of the exact sum; on mixed
batches whose rows come in no slot order, with base rows (slot -1) that must stay bit-identical, strided x and a
column slice of a wider out whose other columns must stay untouched."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; only Triton reads it

from engine.kernels import cpu_kernel  # noqa: E402
from engine.lora import kernels  # noqa: E402
from tests.engine.cpu_flags import cpu_flags  # noqa: E402
from tests.engine.triton_compile import HOPPER_SHARED_BYTES, hopper_shared_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEVICE = torch.device("cuda" if CUDA else "cpu")
# SmolLM2-135M's fused projections: (in_features, out_features, rank: parts x 16)
REAL_SHAPES = {"qkv": (576, 960, 48), "o": (576, 576, 16), "gate_up": (576, 3072, 32), "down": (1536, 576, 16)}
PAD = 5  # extra columns around x's and out's views


class Batch:
    """A random mixed batch: x a row-strided view, out a column slice of a wider tensor, slots in no order."""

    def __init__(self, rows: int, in_features: int, out_features: int, rank: int, num_slots: int, dtype: torch.dtype,
                 seed: int, slots: list[int] | None = None, device: torch.device | str = "cpu") -> None:
        generator = torch.Generator().manual_seed(seed)
        x_full = torch.randn(rows, in_features + 2 * PAD, generator=generator)
        self.x = x_full.to(dtype).to(device)[:, PAD:PAD + in_features]
        self.out_full = torch.randn(rows, out_features + 2 * PAD, generator=generator).to(dtype).to(device)
        self.out = self.out_full[:, PAD:PAD + out_features]
        self.before = self.out_full.clone()
        # magnitudes of a real adapter's product: A ~ 1/sqrt(in), B (scaling folded in) of unit order
        self.lora_a = (torch.randn(num_slots, rank, in_features, generator=generator) / in_features ** 0.5).to(device)
        self.lora_b = torch.randn(num_slots, rank, out_features, generator=generator).to(device)
        if slots is None:  # every slot used, about 1/9 base rows, shuffled
            slots = [t % (num_slots + 1) - 1 for t in range(rows)]
            slots = [slots[i] for i in torch.randperm(rows, generator=generator).tolist()]
        self.slots = torch.tensor(slots, dtype=torch.int64, device=device)

    def exact(self) -> torch.Tensor:
        """out's columns after the product, in float64 (base rows: as before)."""
        exact = self.before[:, PAD:-PAD].double()
        for slot in range(self.lora_a.shape[0]):
            rows = self.slots == slot
            exact[rows] += (self.x[rows].double() @ self.lora_a[slot].double().T) @ self.lora_b[slot].double()
        return exact

    def check(self, dtype: torch.dtype) -> None:
        """The product within rounding of exact; base rows and the columns around the view bit-identical."""
        base = self.slots < 0
        assert torch.equal(self.out_full[base], self.before[base]), "a base row (slot -1) changed"
        assert torch.equal(self.out_full[:, :PAD], self.before[:, :PAD])
        assert torch.equal(self.out_full[:, -PAD:], self.before[:, -PAD:])
        exact, got = self.exact(), self.out.double()
        if dtype == torch.float32:
            scale = exact.abs().max().item() + 1
            assert (got - exact).abs().max().item() <= 1e-5 * scale
        else:  # within one ulp: the float32 sum (error ~1e-6 of scale) rounded once to bfloat16
            assert ((got - exact).abs() <= exact.abs() * 2.0 ** -7 + 1e-4).all()
        adapted = ~base
        if adapted.any():
            assert not torch.equal(self.out_full[adapted], self.before[adapted]), "the product added nothing"


def cpu_kernel_built() -> None:
    assert cpu_kernel._library() is not None, "this machine has a C compiler: the kernels must build"


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def dtype(request):
    return request.param


@pytest.mark.parametrize("projection", list(REAL_SHAPES))
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_c_kernel_real_shapes(dtype, projection, rows):
    cpu_kernel_built()
    in_features, out_features, rank = REAL_SHAPES[projection]
    batch = Batch(rows, in_features, out_features, rank, 8, dtype, seed=rows,
                  slots=[3] if rows == 1 else None)
    cpu_kernel.lora(batch.x, batch.out, batch.lora_a, batch.lora_b, batch.slots)
    batch.check(dtype)


@pytest.mark.parametrize("rows, in_features, out_features, rank, num_slots", [
    (37, 37, 70, 5, 3),  # no size a multiple of a vector: every edge path
    (19, 24, 9, 1, 2),  # out narrower than one vector, rank 1
    (50, 130, 200, 67, 4),  # odd rank over several shrink chunks
    (9, 16, 48, 8, 8),  # about one row per slot
])
def test_c_kernel_odd_shapes(dtype, rows, in_features, out_features, rank, num_slots):
    cpu_kernel_built()
    batch = Batch(rows, in_features, out_features, rank, num_slots, dtype, seed=rank)
    cpu_kernel.lora(batch.x, batch.out, batch.lora_a, batch.lora_b, batch.slots)
    batch.check(dtype)


def test_c_kernel_leaves_base_only_batches_and_out_of_range_slots_alone():
    cpu_kernel_built()
    batch = Batch(6, 32, 48, 4, 2, torch.float32, seed=0, slots=[-1, -1, 2, 7, -5, -1])  # 2, 7, -5: no slot
    cpu_kernel.lora(batch.x, batch.out, batch.lora_a, batch.lora_b, batch.slots)
    assert torch.equal(batch.out_full, batch.before)


def test_c_kernel_matches_the_torch_reference(dtype):
    """The dispatcher's two CPU paths agree: bit-equal base rows, float32 sums in another order elsewhere."""
    cpu_kernel_built()
    batch = Batch(300, 576, 960, 48, 8, dtype, seed=1)
    reference = batch.out_full.clone()
    kernels.lora_reference(batch.x, reference[:, PAD:-PAD], batch.lora_a, batch.lora_b, batch.slots)
    kernels.lora_apply(batch.x, batch.out, batch.lora_a, batch.lora_b, batch.slots)
    if dtype == torch.float32:
        torch.testing.assert_close(batch.out_full, reference, rtol=1e-5, atol=1e-5)
    else:  # the same float32 sum up to rounding: a different bfloat16 only at a rounding boundary
        assert (batch.out_full != reference).float().mean().item() < 0.01
        torch.testing.assert_close(batch.out_full, reference, rtol=2.0 ** -7, atol=1e-4)
    batch.check(dtype)


def test_environment_forces_the_torch_reference(monkeypatch):
    """`TOKENMILL_CPU_LORA_KERNEL=0`: lora_apply gives the reference's bits; with the kernel, float32 sums in
    another order differ from them somewhere in a big batch (so the two paths really are distinct)."""
    cpu_kernel_built()
    batch = Batch(300, 576, 960, 48, 8, torch.float32, seed=2)
    reference = batch.out.clone()
    kernels.lora_reference(batch.x, reference, batch.lora_a, batch.lora_b, batch.slots)
    monkeypatch.setenv("TOKENMILL_CPU_LORA_KERNEL", "0")
    forced = batch.out.clone()
    kernels.lora_apply(batch.x, forced, batch.lora_a, batch.lora_b, batch.slots)
    assert torch.equal(forced, reference)
    monkeypatch.delenv("TOKENMILL_CPU_LORA_KERNEL")
    kernels.lora_apply(batch.x, batch.out, batch.lora_a, batch.lora_b, batch.slots)
    assert not torch.equal(batch.out, reference)


def test_torch_reference(dtype):
    batch = Batch(40, 24, 36, 6, 3, dtype, seed=3)
    kernels.lora_reference(batch.x, batch.out, batch.lora_a, batch.lora_b, batch.slots)
    batch.check(dtype)


def test_segments_group_rows_by_slot():
    slots = torch.tensor([2, -1, 0, 2, 9, 0, 2, -1])
    order, starts, counts = kernels.segments(slots, 4)
    assert order.tolist()[:5] == [2, 5, 0, 3, 6]  # slot 0's rows, then slot 2's, in their order
    assert sorted(order.tolist()[5:]) == [1, 4, 7]  # base rows (and slot 9, past the slots) last
    assert counts.tolist() == [2, 0, 3, 0] and starts.tolist() == [0, 2, 2, 5]


def test_step_segments_are_computed_once_per_slots_tensor():
    slots = torch.tensor([1, -1, 0, 1])
    first = kernels._step_segments(slots, 2)
    assert kernels._step_segments(slots, 2) is first
    slots[1] = 0  # changed in place: grouped again
    order, starts, counts = kernels._step_segments(slots, 2)
    assert order.tolist() == [1, 2, 0, 3] and counts.tolist() == [2, 2]
    assert kernels._step_segments(slots.clone(), 2) is not kernels._step_segments(slots, 2)


AVX2_FLAGS = ["-O3", "-march=x86-64-v3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
              "-fassociative-math", "-fno-signed-zeros"]


@pytest.mark.skipif(platform.machine() != "x86_64" or not {"avx2", "fma"} <= cpu_flags(),
                    reason="needs an x86-64 CPU with AVX2")
def test_c_kernel_built_for_avx2_only(tmp_path, dtype):
    """lora.c built as -march=native builds it on a CPU without AVX-512 (8-lane vectors), run here."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    csrc = ROOT / "engine" / "kernels" / "csrc"
    target = tmp_path / "lora_avx2.so"
    done = subprocess.run([compiler, *AVX2_FLAGS, str(csrc / "lora.c"), "-o", str(target), "-lm"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    function = getattr(ctypes.CDLL(str(target)), f"lora_{cpu_kernel.SUFFIXES[dtype]}")
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    function.argtypes = [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_int]
    for rows, (in_features, out_features, rank) in ((64, REAL_SHAPES["qkv"]), (37, (37, 70, 5))):
        batch = Batch(rows, in_features, out_features, rank, 8, dtype, seed=4)
        function(batch.x.data_ptr(), batch.x.stride(0), batch.out.data_ptr(), batch.out.stride(0),
                 batch.lora_a.data_ptr(), batch.lora_b.data_ptr(), batch.slots.data_ptr(), rows, in_features,
                 out_features, rank, 8, 2)
        batch.check(dtype)


# Triton: small shapes (each launch takes a fraction of a second in the interpreter)
TRITON_CASES = {
    "mixed": dict(rows=37, in_features=40, out_features=70, rank=12, num_slots=3),  # R padded to 16, masked edges
    "one-row": dict(rows=1, in_features=64, out_features=64, rank=16, num_slots=2, slots=[1]),
    "unused-slots": dict(rows=20, in_features=96, out_features=80, rank=80, num_slots=4,  # two rank blocks
                         slots=[2, -1, 0, 2, 0, -1, 2, 2, 0, -1, 2, 0, 0, 2, -1, 2, 0, 2, 2, 0]),
    "many-rows": dict(rows=70, in_features=16, out_features=16, rank=4, num_slots=1),  # row tiles of one slot
}


@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_kernels(dtype, case):
    from engine.lora.triton_kernels import lora_triton

    batch = Batch(**TRITON_CASES[case], dtype=dtype, seed=len(case), device=DEVICE)
    lora_triton(batch.x, batch.out, batch.lora_a, batch.lora_b, batch.slots)
    batch.check(dtype)


def test_triton_rounds_bfloat16_as_torch():
    """out's value plus the float32 product, rounded to nearest even once: torch's own rounding of the same float32
    sum, bit for bit (the interpreter's cast would truncate)."""
    from engine.lora.triton_kernels import lora_triton

    batch = Batch(16, 32, 64, 16, 1, torch.bfloat16, seed=5, slots=[0] * 16, device=DEVICE)
    lora_triton(batch.x, batch.out, batch.lora_a, batch.lora_b, batch.slots)
    product = (batch.x.float() @ batch.lora_a[0].T) @ batch.lora_b[0]
    expected = (batch.before[:, PAD:-PAD].float() + product).bfloat16()
    assert (batch.out != expected).float().mean().item() < 0.02  # only where the float32 sums' order matters
    torch.testing.assert_close(batch.out, expected, rtol=2.0 ** -7, atol=1e-4)


@pytest.mark.skipif(CUDA, reason="on CUDA the kernels are compiled and run by the tests above")
def test_triton_kernels_compile_for_hopper_without_a_gpu():
    """What the interpreter does not check (types, tl.dot shapes, resources): compile for sm_90 with the launches'
    own parameters, in a fresh process without the interpreter."""
    shared = hopper_shared_bytes("engine.lora.triton_kernels", ["(torch.bfloat16, 48)", "(torch.float32, 16)"])
    assert len(shared) == 2 and max(shared) <= HOPPER_SHARED_BYTES, shared
