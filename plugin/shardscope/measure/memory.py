"""Peak-memory readings for one rank: CUDA's allocator where the run uses a GPU, process RSS on CPU.

`torch.cuda.memory_allocated()` returns 0 on a CPU-only build instead of raising, so the device the
model actually lives on decides which reader runs; a CPU run never reports CUDA zeros.
"""
from __future__ import annotations

import resource

import psutil
import torch


def read_memory(device: torch.device) -> dict:
    """Current readings; `peak_memory_bytes` and `memory_kind` name the headline figure."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "peak_memory_bytes": torch.cuda.max_memory_allocated(device),
            "memory_kind": "cuda_max_allocated",
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device),
            "cuda_alloc_retries": stats.get("num_alloc_retries", 0),
            "cuda_ooms": stats.get("num_ooms", 0),
            "cpu_rss_bytes": psutil.Process().memory_info().rss,
        }
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return {
        "peak_memory_bytes": peak_rss,
        "memory_kind": "cpu_peak_rss",
        "cpu_rss_bytes": psutil.Process().memory_info().rss,
        "cpu_peak_rss_bytes": peak_rss,
    }


def reset_peak(device: torch.device) -> None:
    """Start a new peak interval (CUDA only: a process's peak RSS cannot be reset portably)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_of(accelerator, module) -> torch.device:
    """The device the run trains on: the accelerator's, else the model's (CPU for a model on meta)."""
    if accelerator is not None:
        return torch.device(accelerator.device)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return torch.device("cpu") if device.type == "meta" else device


def memory_kind(device: torch.device, memory: dict, rank: dict) -> str | None:
    """What a rank's `peak_memory_bytes` is: CUDA's allocator peak, or on CPU the instrumented step's tensor peak."""
    if device.type == "cuda":
        return memory.get("memory_kind")
    return "tensor_peak" if rank.get("peak_memory_bytes") is not None else None
