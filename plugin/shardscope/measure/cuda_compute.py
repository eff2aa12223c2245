"""Compute time on a CUDA rank: each step's GPU time on the compute stream less its collectives' GPU time.

On a CPU rank `compute_seconds` is the training thread's CPU time (`throughput.ThroughputWindow`). On a CUDA rank
that clock measures the thread that launches the kernels, not the kernels. There, per optimizer step:

    compute_s = (span_ms - min(span_ms, comm_ms)) / 1000

- `span_ms`: `begin.elapsed_time(end)` of two `torch.cuda.Event(enable_timing=True)` recorded on the current
  (compute) stream where the step's wall time starts and ends (the throughput window's step begin and end);
- `comm_ms`: the sum of the GPU durations of the NCCL collectives this rank issued between the two (the entries of
  torch's flight recorder created, on the CPU clock, inside the step). ProcessGroupNCCL times each collective with
  its own pair of CUDA events on the stream the collective runs on, when timing is on (`TORCH_NCCL_ENABLE_TIMING`:
  `collective_log.record_by_default` sets it where unset; `enable_timing` turns it on for the default group made
  before), and writes the duration into the ring (`duration_ms`) when its watchdog retires the work. A collective's
  time includes its wait for the last rank to arrive: that wait is what leaves the slowest rank's compute the largest.

Stated biases (the same formula on every rank, so ranks compare): communication that overlaps compute (DDP's
bucketed all-reduce during backward, FSDP's prefetched all-gathers) is subtracted as if the compute stream had
waited for it, and collectives of two process groups running at once are both subtracted (capped at the span);
while the GPU idles outside collectives (data loading, a launch-bound stretch) the span still counts. So compute_s
is the step's time outside its collectives, not the kernels' busy time. Nothing is synchronised for it: events and
durations are read at the next logging point (`collect`); a step whose end event has not completed or whose
collectives the watchdog has not retired yet waits for a later one; a step the ring (bounded,
`collective_log.ENTRIES`) no longer holds all the collectives of is left out (`lost`).

Run on one H200 (benchmarks/results/gpu_check.md, 1 rank under the plain Trainer, FSDP2 and ZeRO-3 over NCCL): the
run's compute_s within 1% of an independent CUDA-event timing of the same steps less the NCCL durations of the
collectives created in them. What a one-rank run cannot show (a slow rank's compute_s beside the others', DDP's
overlapped all-reduce) needs 2 GPUs: the check's list says how to run it.
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass

from . import collective_log
from .collective_log import TIMING

PENDING, LOST = "pending", "lost"  # a step not readable yet; a step whose collectives the ring no longer holds
MAX_PENDING = 1000  # steps kept unread at most (older ones are lost): a bound on the events held


class TimingOff(Exception):
    """The flight recorder retired a collective without a duration: NCCL timing is off for its group."""


@dataclass
class Mark:
    """A point of a step: a timing event recorded on the compute stream, and the CPU clock of the flight recorder
    (`time.time_ns`) when it was recorded."""

    event: object  # torch.cuda.Event(enable_timing=True), or any object with query() and elapsed_time(other)
    ns: int


def on_gpu(entry: dict) -> bool:
    """A flight-recorder entry of a collective that runs on a GPU stream (NCCL), not gloo's CPU work."""
    return str(entry.get("profiling_name", "")).startswith("nccl:")


def oldest_kept(entries: list[dict]) -> int | None:
    """The creation time of the ring's oldest entry where older ones were overwritten (record ids start at 0),
    else None: a step that began before it may have lost collectives."""
    if entries and entries[0].get("record_id", 0) > 0:
        return entries[0].get("time_created_ns", 0)
    return None


def step_compute(begin: Mark, end: Mark, entries: list[dict], kept_since: int | None):
    """Compute seconds of the step between `begin` and `end` (the module's formula), PENDING or LOST."""
    if not end.event.query():
        return PENDING
    if kept_since is not None and begin.ns < kept_since:
        return LOST
    comm_ms = 0.0
    for entry in entries:
        if on_gpu(entry) and begin.ns <= entry.get("time_created_ns", -1) < end.ns:
            if "duration_ms" not in entry:
                if entry.get("retired"):
                    raise TimingOff(f"{entry.get('profiling_name')} of group {entry.get('process_group')} was "
                                    "timed by no CUDA events (TORCH_NCCL_ENABLE_TIMING off when the group was made)")
                return PENDING
            comm_ms += float(entry["duration_ms"])
    span_ms = begin.event.elapsed_time(end.event)
    return (span_ms - min(span_ms, comm_ms)) / 1000


def ring_entries() -> list[dict]:
    """The flight recorder's entries, oldest first (`collective_log.ring_entries`: NCCL's ring and the others');
    none on a process without a process group (one GPU: a step's compute is its span)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return []
    return collective_log.ring_entries()


def cuda_mark() -> Mark:
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()  # on the current stream: the one the step's kernels run on
    return Mark(event, time.time_ns())


def enable_timing() -> None:
    """NCCL timing on for the default process group where it was made before `TORCH_NCCL_ENABLE_TIMING` was set
    (groups made later read the variable); nothing to do without one. A user's 0 is kept: no figure then."""
    import torch.distributed as dist

    off = [f"{name}={os.environ[name]}" for name in TIMING if os.environ.get(name, "1").strip() in ("0", "")]
    if off:
        raise RuntimeError(f"{off[0]}: NCCL times no collective, so GPU compute time is left out")
    if dist.is_available() and dist.is_initialized():
        if "nccl" not in str(dist.get_backend()):
            raise RuntimeError(f"the {dist.get_backend()} backend puts no GPU time in torch's flight recorder "
                               "(NCCL does): GPU compute time left out")
        try:
            dist.distributed_c10d._get_default_group()._enable_collectives_timing()
        except RuntimeError:  # a gloo backend beside NCCL's (`cuda:nccl,cpu:gloo`) has no timing to turn on: a step
            pass  # whose collectives come without durations says so at `collect` (TimingOff)


def gpu_compute(device, instrument) -> CudaCompute | None:
    """A `CudaCompute` for a CUDA rank, NCCL timing turned on (None on other devices, or where it cannot be had:
    `instrument` says why)."""
    if device.type != "cuda":
        return None
    with instrument:
        enable_timing()
        return CudaCompute()
    return None


class CudaCompute:
    """The steps' marks (`step_begin`, `restart`, `step_end`: as `ThroughputWindow`'s), read into compute seconds
    at `collect()`: `interval` (since `reset`) and `run`; `lost` steps left out. `mark` and `entries` are
    `cuda_mark` and `ring_entries` (stand-ins in tests)."""

    def __init__(self, mark=cuda_mark, entries=ring_entries):
        self.mark, self.entries = mark, entries
        self.pending: deque[tuple[Mark, Mark]] = deque()
        self.anchor, self.interval, self.run, self.lost = None, 0.0, 0.0, 0

    def step_begin(self) -> None:
        if self.anchor is None:
            self.anchor = self.mark()

    def restart(self) -> None:
        self.anchor = self.mark()

    def step_end(self, pause_after: bool = False, count: bool = True) -> None:
        now = self.mark()
        if self.anchor is not None and count:
            self.pending.append((self.anchor, now))
            if len(self.pending) > MAX_PENDING:
                self.pending.popleft()
                self.lost += 1
        self.anchor = None if pause_after else now

    def reset(self) -> None:
        self.interval = 0.0

    def collect(self, settle_s: float = 0.0) -> None:
        """Read every step that can be read now, oldest first; `settle_s`: at the run's end, wait up to that long
        for the watchdog to retire the last steps' collectives (raises TimingOff: the figure cannot be had)."""
        deadline = time.monotonic() + settle_s
        self._read()
        while self.pending and time.monotonic() < deadline:
            time.sleep(0.05)
            self._read()

    def _read(self) -> None:
        if not self.pending:
            return
        entries = self.entries()
        kept_since = oldest_kept([e for e in entries if on_gpu(e)])  # record ids count within NCCL's own ring
        while self.pending:
            result = step_compute(*self.pending[0], entries, kept_since)
            if result is PENDING:
                return
            self.pending.popleft()
            if result is LOST:
                self.lost += 1
            else:
                self.interval += result
                self.run += result
