"""Catalogue of accelerators: dense bf16 and fp8 peak FLOP/s, memory and memory bandwidth.

Figures are the vendors' datasheet numbers for dense (not 2:4 sparse) bf16 and fp8 tensor-core throughput
(the datasheets print the sparse figure, twice the dense one; A100 has no FP8 tensor cores).
How close to these figures each accelerator runs is its profile (:mod:`pipesched.optimizer.cost.profile`).
Memory is given as the vendor's nominal size read as GiB (what ``nvidia-smi``/``rocm-smi`` report is
within a few percent of it); set ``cluster.memory_bytes`` to override.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CATALOGUE", "Accelerator", "accelerator_names", "get_accelerator"]

GIB = 1024**3


@dataclass(frozen=True)
class Accelerator:
    """One accelerator model.

    Attributes:
        name: catalogue key, e.g. ``"H100-SXM"``.
        flops_per_s: dense bf16 tensor-core peak, FLOP/s.
        memory_bytes: device memory, bytes.
        memory_bandwidth_bytes_per_s: device memory (HBM/GDDR) bandwidth, bytes/s.
        source: where the figures come from.
        fp8_flops_per_s: dense fp8 tensor-core peak, FLOP/s (None: no FP8 tensor cores).
        flops_per_exponential: dense bf16 tensor-core FLOPs per exponential of the special-function units in the
            same time (peak ÷ exponentials per second: SMs × 16 SFU lanes × clock on NVIDIA's GA100/GH100);
            FlashAttention's softmax takes one exponential per score (:mod:`pipesched.optimizer.cost.timing`).
            None where not stated: attention's speed is then taken as independent of the head size.
    """

    name: str
    flops_per_s: float
    memory_bytes: float
    memory_bandwidth_bytes_per_s: float
    source: str
    fp8_flops_per_s: float | None = None
    flops_per_exponential: float | None = None


#: GA100 (A100 whitepaper, 2020: 108 SMs, 16 SFU lanes per SM, 1,410 MHz boost): 2.44e12 exponentials/s beside
#: 312e12 bf16 FLOP/s.
_GA100_FLOPS_PER_EXPONENTIAL = 312e12 / (108 * 16 * 1.41e9)
#: GH100 SXM: "the H100 SXM5 GPU has 989 TFLOPS of FP16 matmul but only 3.9 TFLOPS of special functions"
#: (Shah et al. 2024, FlashAttention-3, §3.1); H200 is the same die at the same clock.
_GH100_SXM_FLOPS_PER_EXPONENTIAL = 989.5e12 / 3.9e12
#: GH100 PCIe (H100 whitepaper, 2022: 114 SMs, 1,755 MHz boost, 16 SFU lanes per SM).
_GH100_PCIE_FLOPS_PER_EXPONENTIAL = 756.5e12 / (114 * 16 * 1.755e9)

CATALOGUE: dict[str, Accelerator] = {
    accelerator.name: accelerator
    for accelerator in (
        # NVIDIA A100 Tensor Core GPU datasheet (2021): BF16 312 TFLOPS dense; 40GB HBM2 1,555 GB/s (SXM).
        Accelerator(
            "A100-40GB",
            312e12,
            40 * GIB,
            1.555e12,
            "NVIDIA A100 datasheet, SXM 40GB",
            flops_per_exponential=_GA100_FLOPS_PER_EXPONENTIAL,
        ),
        # Same datasheet: 80GB HBM2e, 2,039 GB/s (SXM). The Zero Bubble paper's profiles were taken on it.
        Accelerator(
            "A100-80GB",
            312e12,
            80 * GIB,
            2.039e12,
            "NVIDIA A100 datasheet, SXM 80GB",
            flops_per_exponential=_GA100_FLOPS_PER_EXPONENTIAL,
        ),
        # NVIDIA H100 Tensor Core GPU datasheet: SXM BF16 1,979 TFLOPS with sparsity → 989.5 dense, FP8 3,958 → 1,979;
        # 80GB, 3.35 TB/s.
        Accelerator(
            "H100-SXM",
            989.5e12,
            80 * GIB,
            3.35e12,
            "NVIDIA H100 datasheet, H100 SXM",
            1979e12,
            _GH100_SXM_FLOPS_PER_EXPONENTIAL,
        ),
        # Same datasheet: PCIe BF16 1,513 TFLOPS with sparsity → 756.5 dense, FP8 3,026 → 1,513; 80GB, 2 TB/s.
        Accelerator(
            "H100-PCIe",
            756.5e12,
            80 * GIB,
            2.0e12,
            "NVIDIA H100 datasheet, H100 PCIe",
            1513e12,
            _GH100_PCIE_FLOPS_PER_EXPONENTIAL,
        ),
        # NVIDIA H200 datasheet: SXM BF16 1,979 TFLOPS with sparsity → 989.5 dense, FP8 3,958 → 1,979; 141GB HBM3e,
        # 4.8 TB/s.
        Accelerator(
            "H200",
            989.5e12,
            141 * GIB,
            4.8e12,
            "NVIDIA H200 datasheet, H200 SXM",
            1979e12,
            _GH100_SXM_FLOPS_PER_EXPONENTIAL,
        ),
        # NVIDIA DGX B200 datasheet: 72 PFLOPS FP8 training for 8 GPUs (9 per GPU with sparsity → 4.5 dense);
        # B200 BF16 2.25 PFLOPS dense;
        # 1,440GB HBM3e for 8 GPUs → 180GB each, 8 TB/s each.
        Accelerator("B200", 2.25e15, 180 * GIB, 8.0e12, "NVIDIA DGX B200 datasheet, per GPU", 4.5e15),
        # AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS dense, FP8 2,614.9 dense; 192GB HBM3, 5.3 TB/s.
        Accelerator("MI300X", 1307.4e12, 192 * GIB, 5.3e12, "AMD Instinct MI300X datasheet", 2614.9e12),
        # AMD Instinct MI325X datasheet: the MI300X's CDNA3 compute (304 CUs; BF16 1,307.4 TFLOPS dense, FP8 2,614.9
        # dense) with 256GB HBM3E at 6 TB/s.
        Accelerator("MI325X", 1307.4e12, 256 * GIB, 6.0e12, "AMD Instinct MI325X datasheet", 2614.9e12),
        # AMD Instinct MI355X datasheet: CDNA 4, 256 CUs at up to 2.4 GHz; BF16 2.5 PFLOPS dense (256 × 4,096 FLOP a
        # CU a clock × 2.4 GHz = 2,516.6 TFLOPS), FP8 5.0 dense (8,192 a CU a clock: 5,033.2); 288GB HBM3E, 8 TB/s;
        # 1,400 W.
        Accelerator("MI355X", 2516.6e12, 288 * GIB, 8.0e12, "AMD Instinct MI355X datasheet", 5033.2e12),
        # AMD Instinct MI350X datasheet: the MI355X's CDNA 4 die at up to 2.2 GHz and 1,000 W (air-cooled); BF16 2.3
        # PFLOPS dense (256 × 4,096 × 2.2 GHz = 2,306.9 TFLOPS), FP8 4.6 (4,613.7); 288GB HBM3E, 8 TB/s.
        Accelerator("MI350X", 2306.9e12, 288 * GIB, 8.0e12, "AMD Instinct MI350X datasheet", 4613.7e12),
        # NVIDIA L40S datasheet: BF16 Tensor Core 362.05 TFLOPS dense (733 with sparsity), FP8 733 dense (1,466 with
        # sparsity); 48GB GDDR6, 864 GB/s.
        Accelerator("L40S", 362.05e12, 48 * GIB, 864e9, "NVIDIA L40S datasheet", 733e12),
    )
}


def accelerator_names() -> list[str]:
    """The catalogue's names, in catalogue order."""
    return list(CATALOGUE)


def get_accelerator(name: str) -> Accelerator:
    """The catalogue entry for ``name`` (case-insensitive).

    Raises:
        KeyError: with the catalogue's names when ``name`` is unknown.
    """
    for key, accelerator in CATALOGUE.items():
        if key.lower() == name.lower():
            return accelerator
    raise KeyError(f"unknown accelerator {name!r}: the catalogue has {', '.join(CATALOGUE)}")
