"""Our CPU kernels: the C sources in csrc/, built and loaded by `cpu_kernel` (paged decode attention, fused layer and
encoder ops, LoRA, sampling, whole decode layers), and `cpu_gemm`, the GEMMs on prepacked weights."""
