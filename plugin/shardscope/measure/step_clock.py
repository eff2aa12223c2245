"""The times the profiler keeps of the optimizer steps, marked together on every clock it reads.

`StepClock` holds the logging interval's `ThroughputWindow` and the whole run's (wall time, and on a CPU rank the
training thread's CPU time) and, on a CUDA rank, the steps' CUDA events (`cuda_compute.CudaCompute`, under its own
instrument: a failure there leaves the rest measured). `compute_seconds` is the `compute_seconds` a measurement
sends: on a CPU rank the window's thread CPU time, on a CUDA rank the GPU compute time read so far, else None.
"""
from __future__ import annotations

import functools
import time

import torch

from .cuda_compute import gpu_compute
from .guard import Instrument
from .throughput import ThroughputWindow


class StepClock:
    """`mark(method, ...)`: a `ThroughputWindow` method (step_begin, restart, add_batch, step_end) on both windows
    (and the CUDA events); `interval` (reset at each logging measurement, `reset_interval`) and `run`."""

    def __init__(self, device: torch.device, instrument: Instrument):
        window = functools.partial(ThroughputWindow, time.perf_counter)
        self.interval, self.run, self.device, self.instrument = window(), window(), device, instrument
        self.gpu = gpu_compute(device, instrument)  # None on other devices, or where NCCL timing cannot be had

    def mark(self, method: str, *args, **kwargs) -> None:
        if method == "step_end" and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels are async: close the window on real time
        getattr(self.interval, method)(*args, **kwargs)
        getattr(self.run, method)(*args, **kwargs)
        if self.gpu is not None and self.instrument.ok and method != "add_batch":
            with self.instrument:  # the step's CUDA events (no synchronisation of their own)
                getattr(self.gpu, method)(*args, **kwargs)

    def reset_interval(self) -> None:
        self.interval.reset()
        if self.gpu is not None:
            self.gpu.reset()

    def compute_seconds(self, summary: bool) -> float | None:
        """Compute seconds over the run (`summary`) or the interval: CPU time on a CPU rank, GPU compute time read so
        far on a CUDA rank (the run's last steps given up to 1 s to be read), None otherwise."""
        if self.device.type == "cpu":
            return (self.run if summary else self.interval).compute
        with self.instrument:
            if self.gpu is not None and self.instrument.ok:
                self.gpu.collect(settle_s=1.0 if summary else 0.0)
                return self.gpu.run if summary else self.gpu.interval
        return None
