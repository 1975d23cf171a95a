"""What NVIDIA's data sheets say a GPU computes at its peak: the one table the profiler's MFU and the
simulator's cluster presets both read (no torch here, so the simulator stays torch-free).

Dense TFLOP/s by a substring of the device's name as CUDA reports it (the first that matches wins,
so the specific names come first) and the matrix unit's input type: ``bf16`` (fp16 alike), ``tf32``
(fp32 with TF32 allowed), ``fp32``, and ``fp8`` where the GPU has fp8 tensor cores (Hopper on).
"""

from __future__ import annotations

DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0, "fp8": 1513.0},
    "H100 NVL": {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0, "fp8": 1671.0},
    "H100": {"bf16": 989.0, "tf32": 494.7, "fp32": 66.9, "fp8": 1979.0},  # SXM: "NVIDIA H100 80GB HBM3"
    "H200": {"bf16": 989.0, "tf32": 494.7, "fp32": 66.9, "fp8": 1979.0},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},  # SXM and PCIe alike
    # SXM2 and SXM3. Its 16-bit peak is fp16's: Volta's tensor cores have no bf16, which runs far slower.
    "V100": {"bf16": 125.0, "fp32": 15.7},
}

# GPUs whose tensor cores take no bf16 (Volta: the V100 data sheet lists fp16 tensor-core FLOPS only;
# bf16 arrived with Ampere): 16-bit mixed precision on them is fp16.
NO_BF16 = frozenset({"V100"})

# Streaming multiprocessors, by the same names: a collective's kernels hold some of them from compute.
SMS: dict[str, int] = {"H100": 132, "H200": 132, "A100": 108, "V100": 80}


def datasheet_tflops(device_name: str, kind: str) -> float | None:
    """The peak of the first table entry whose key ``device_name`` contains, or None (also for a
    kind the GPU has no tensor cores for)."""
    return next((peaks.get(kind) for key, peaks in DATASHEET_TFLOPS.items() if key in device_name), None)
