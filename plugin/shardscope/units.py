"""Sizes, counts and GPUs: parsing what users type and printing what the tools report.

Printed GB are 10**9 bytes; GPU capacities in `GPUS` are GiB (2**30), as `nvidia-smi` totals show them.
"""
from __future__ import annotations

import re

from .errors import UsageError

# Nominal memory per GPU (datasheet "GB" as GiB, which is what nvidia-smi totals show for A100).
GPUS = {
    "A100-40": (40, "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    "A100-80": (80, "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    "H100": (80, "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (SXM and PCIe: 80 GB)"),
    "H100-NVL": (94, "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (NVL: 94 GB)"),
    "H200": (141, "https://www.nvidia.com/en-us/data-center/h200/"),
    "L4": (24, "https://www.nvidia.com/en-us/data-center/l4/"),
    "L40S": (48, "https://www.nvidia.com/en-us/data-center/l40s/"),
    "A10G": (24, "https://aws.amazon.com/ec2/instance-types/g5/"),
    "A10": (24, "https://www.nvidia.com/en-us/data-center/products/a10-gpu/"),
    "V100-16": (16, "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    "V100-32": (32, "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    "T4": (16, "https://www.nvidia.com/en-us/data-center/tesla-t4/"),
    "TITAN-RTX": (24, "https://www.nvidia.com/en-us/deep-learning-ai/products/titan-rtx/"),
    "RTX-4090": (24, "https://www.nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4090/"),
    "RTX-A6000": (48, "https://www.nvidia.com/en-us/design-visualization/rtx-a6000/"),
    "MI300X": (192, "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"),
}


def as_int(value) -> int | None:
    """`int(value)` for a config value that may be a string, or None where it is no integer."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def gb(n: float | None) -> str:
    """Bytes as GB (1e9), 3 significant digits below 10 GB."""
    return "-" if n is None else f"{n / 1e9:.3g}" if n < 1e10 else f"{n / 1e9:.1f}"


def gpu_size(n: int) -> str:
    """GPU memory as the card is sold: '80 GiB (85.9 GB)' for a whole number of GiB, else 'GB'."""
    gib = n / 2 ** 30
    return f"{gib:g} GiB ({gb(n)} GB)" if gib == int(gib) else f"{gb(n)} GB"


MAX_BYTES = 10 ** 15   # per GPU: a petabyte, far above any accelerator (the largest hold ~0.2 TB)
MAX_PARAMS = 10 ** 14  # 100 trillion, far above any model trained so far (~2e12)
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30,
          "ti": 2 ** 40}


def parse_size(text: str, what: str = "--gpu-memory") -> int:
    """'80GB' (1e9), '80GiB' (2**30), '8.6e10' (bytes); a bare number below 1e6 is GiB."""
    if str(text).strip().startswith("-"):
        raise UsageError(f"{what} must be positive, got '{text}'")
    match = _SIZE.match(str(text))
    if not match:
        raise UsageError(f"{what} '{text}' is not a size (e.g. 80GB, 80GiB, 85899345920)")
    value, unit = float(match.group(1)), (match.group(2) or "").lower().rstrip("b")
    if not unit and (match.group(2) or "") == "" and value < 1e6:
        unit = "gi"
    if value <= 0:
        raise UsageError(f"{what} must be positive, got '{text}'")
    if not value * _UNITS[unit] <= MAX_BYTES:  # also inf: '1e400' parses as a float
        raise UsageError(f"{what} '{text}' is more than any accelerator holds (at most 1 PB)")
    return int(value * _UNITS[unit])


def parse_count(text: str, what: str = "--params") -> float:
    """'7e9', '7B', '350M', '70b'."""
    match = re.match(r"^\s*(-?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmbt]?)\s*$", str(text), re.IGNORECASE)
    if not match:
        raise UsageError(f"{what} '{text}' is not a number (e.g. 7e9 or 7B)")
    value = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2).lower()]
    if value <= 0:
        raise UsageError(f"{what} must be positive, got '{text}'")
    if not value <= MAX_PARAMS:  # also inf: '1e400' parses as a float
        raise UsageError(f"{what} '{text}' is more parameters than any model has ({MAX_PARAMS:.0e} at most)")
    return value


def gpu_memory(name: str) -> int:
    """Memory of a GPU in `GPUS`, in bytes (its GiB x 2**30)."""
    key = {k.lower(): k for k in GPUS}.get(name.lower().replace("_", "-"))
    if key is None:
        raise UsageError(f"unknown GPU '{name}' (known: {', '.join(GPUS)}; or give --gpu-memory 80GiB)")
    return GPUS[key][0] * 2 ** 30


# Dense (not 2:4-sparse) peak tensor-core TFLOP/s per device, from NVIDIA's datasheets.
# Matched against torch.cuda.get_device_name() in order: first key contained in the name wins.
PEAK_TFLOPS = {
    "h100 nvl": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "h100 pcie": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "h100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM5 ("H100 80GB HBM3")
    "h200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "a100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "l40s": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "l4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "v100": {"fp16": 125.0, "fp32": 15.7},
    "titan rtx": {"fp16": 130.5, "fp32": 16.3},  # TITAN RTX (Turing): tensor cores with fp32 accumulate; CUDA cores
}


def peak_flops(device_name: str | None, dtype: str, overrides: dict | None = None) -> float | None:
    """Dense peak FLOP/s for `device_name` at `dtype`, or None when unknown (then MFU is omitted)."""
    if not device_name:
        return None
    name = device_name.lower()
    for key, per_dtype in {**(overrides or {}), **PEAK_TFLOPS}.items():
        if key.lower() in name:
            tflops = per_dtype.get(dtype) if isinstance(per_dtype, dict) else per_dtype
            return None if tflops is None else tflops * 1e12
    return None
