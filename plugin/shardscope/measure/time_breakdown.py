"""Where one optimizer step's time goes on this rank, from the torch profiler over a sampled step: the summary's
`time_breakdown` (the step's time as measured; the planner's prediction of it is plan/'s).

The step runs from the end of the previous optimizer step to the end of this one (the throughput
window's definition, so data loading counts). Hooks mark phases as profiler ranges on the training thread:
- forward: the model's forward (pre-hook to post-hook), each micro-batch;
- backward: from a forward's end to the next forward or the optimizer step: the backward pass, the
  gradient synchronisation a library waits for at its end, gradient clipping;
- optimizer: the innermost torch optimizer's step, or DeepSpeed ZeRO's whole step (partition update and
  the parameter all-gather after it); `optimizer_update_s`, inside it, is the innermost torch optimizer's
  step alone (the weight update; for ZeRO, the rest of its step is DeepSpeed's copies and bookkeeping);
- data_wait: from the step's start to its first forward: the data loader and what the Trainer does
  between steps (logging);
- other: the rest (zero_grad, the scheduler, callbacks).
Library: `library_s` is the part of forward and backward spent inside a sharding library's own per-module work
(gathering and releasing parameters, copying gradients out), waits for collectives excepted: FSDP names it in the
profiler itself ("FSDP::..." ranges, "FullyShardedDataParallel...." for FSDP1); DeepSpeed ZeRO-3's four
sub-module functions (fetch before a module's forward and backward, release after) and its gradient work (each
gradient into the reduce bucket, a full bucket reduced and partitioned, and at backward's end the last bucket:
`independent_gradient_partition_epilogue`) are timed in ranges of ours.
DDP's reducer works in C++ autograd hooks and stays in compute.
Communication: `comm_s` is the time a collective is in flight (the union of the backend's collective
events: gloo's work on its own threads, NCCL kernels on the GPU); `exposed_comm_s` is the part of it
when no compute operator runs (CPU operators outside the communication threads on CPU, GPU kernels on
CUDA): the wait that overlap did not hide. Exposed time is taken out of the phase it fell in, so

    forward_s + backward_s + optimizer_s + exposed_comm_s + data_wait_s + other_s = step_s

(up to float rounding); `comm_s`, overlapped or not, `optimizer_update_s` and `library_s` stand beside the sum.
"""
from __future__ import annotations

import math

import torch
from torch.autograd.profiler import record_function

from .state_bytes import base_optimizer, zero_optimizer
from .guard import Instrument, MethodWrap

PREFIX = "shardscope::"
PARTS = ("forward_s", "backward_s", "optimizer_s", "exposed_comm_s", "data_wait_s", "other_s")  # sum to step_s
BREAKDOWN = ("forward_s", "backward_s", "optimizer_s", "optimizer_update_s", "comm_s", "exposed_comm_s", "data_wait_s",
             "other_s", "step_s", "library_s")
LIBRARY_RANGES = ("FSDP::", "FullyShardedDataParallel.", PREFIX + "library")  # the libraries' own, and ours
ZERO3_MODULE_WORK = ("pre_sub_module_forward_function", "post_sub_module_forward_function",
                     "pre_sub_module_backward_function", "post_sub_module_backward_function")
# each gradient into the bucket (reduced and partitioned when full), and the last bucket at backward's end
ZERO3_GRADIENT_WORK = ("reduce_ready_partitions_and_remove_grads", "independent_gradient_partition_epilogue")
RANK_FIELDS = (*(f"time_{key}" for key in BREAKDOWN), "time_timed_steps")  # what a rank sends in the gather


class StepTimer:
    """`timer.start()` where the step begins, `timer.stop()` -> breakdown dict where it ends (same thread). Its
    hooks and phase marks run under `instrument`: after a failure `stop()` returns None and the step goes on."""

    def __init__(self, model, optimizer, device: torch.device | None, instrument: Instrument):
        self.model, self.optimizer, self.instrument = model, optimizer, instrument
        self.cuda = device is not None and device.type == "cuda"
        self._open = self._step = self._profiler = self._update = None

    def start(self) -> "StepTimer":
        from torch.profiler import ProfilerActivity, profile

        if torch._C._autograd._profiler_enabled():  # a second profiler would end the user's session
            raise RuntimeError("a torch profiler is already running; the step is not broken down")
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        self._step = record_function(PREFIX + "step").__enter__()
        self._install()
        return self

    def stop(self) -> dict | None:
        """The step's breakdown (None when the instrument failed during the step)."""
        try:
            self._updating(False, whole=True)  # the open phase, and an update range a failed step left open
            if self.cuda and self.instrument.ok:
                torch.cuda.synchronize()
            self._step.__exit__(None, None, None)
        finally:
            self.instrument.remove()
            self._profiler.__exit__(None, None, None)
        return breakdown(_intervals(self._profiler.events(), self.cuda)) if self.instrument.ok else None

    def _mark(self, phase: str | None) -> None:
        """Close the phase range that is open and open `phase` (None: none)."""
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
        if phase is not None:
            self._open = record_function(PREFIX + phase).__enter__()

    def _updating(self, on: bool, whole: bool) -> None:
        """Open (on) or close the range of the innermost optimizer's step (ZeRO-3 runs it once per sub-group);
        `whole`: it is the optimizer phase too (no ZeRO around it)."""
        if on:
            if whole:
                self._mark("optimizer")
            self._update = record_function(PREFIX + "update").__enter__()
            return
        if self._update is not None:
            self._update, update = None, self._update
            update.__exit__(None, None, None)
        if whole:
            self._mark(None)

    def _install(self) -> None:
        model, hook = self.model, self.instrument.hook
        hook(model.register_forward_pre_hook, lambda *_: self._mark("forward"), prepend=True)
        hook(model.register_forward_hook, lambda *_: self._mark("backward"), always_call=True)
        zero, base = zero_optimizer(self.optimizer), base_optimizer(self.optimizer)
        if zero is not None:  # ZeRO's step holds the partition update and the all-gather: time it whole
            MethodWrap(self.instrument, zero, "step", lambda *_: self._mark("optimizer"), lambda: self._mark(None))
        if base is not None:
            hook(base.register_step_pre_hook, lambda *_: self._updating(True, whole=zero is None))
            hook(base.register_step_post_hook, lambda *_: self._updating(False, whole=zero is None))
        offload = getattr(zero, "parameter_offload", None)  # ZeRO-3's per-module fetch and release
        work = [(offload, name) for name in ZERO3_MODULE_WORK] + [(zero, name) for name in ZERO3_GRADIENT_WORK]
        for owner, name in work if offload is not None else ():
            if not hasattr(owner, name):  # another DeepSpeed version: that part stays in compute
                continue
            ranges = []
            MethodWrap(self.instrument, owner, name, lambda *_, r=ranges: r.append(
                record_function(PREFIX + "library").__enter__()), lambda r=ranges: r.pop().__exit__(None, None, None))


def _intervals(events, cuda: bool) -> dict:
    """Profiler events -> {phase name: [(start, end)], "comm": [...], "compute": [...]} in microseconds."""
    out = {"comm": [], "compute": []}
    cpu_ops = []
    for event in events:
        name, span = event.name, (event.time_range.start, event.time_range.end)
        on_device = event.device_type != torch.autograd.DeviceType.CPU
        if name.startswith(LIBRARY_RANGES):
            out.setdefault("library", []).append(span)
        elif name.startswith(PREFIX):
            out.setdefault(name[len(PREFIX):], []).append(span)
        elif on_device:
            out["comm" if "nccl" in name.lower() else "compute"].append(span)
        elif name.startswith(("gloo:", "mpi:", "ucc:")):
            out["comm"].append(span)
            out.setdefault("comm_threads", set()).add(event.thread)
        elif name.startswith("aten::") and not cuda:
            cpu_ops.append((event.thread, span))
    threads = out.pop("comm_threads", set())
    out["compute"] += [span for thread, span in cpu_ops if thread not in threads]
    return out


def breakdown(spans: dict) -> dict:
    """Seconds per part (see the module docstring) from `_intervals`' spans of one step."""
    if not spans.get("step"):
        raise ValueError("the profiler recorded no step range")
    step = [spans["step"][0]]
    phases = {p: _clip(_union(spans.get(p, [])), step) for p in ("forward", "backward", "optimizer")}
    forwards = phases["forward"]
    phases["data_wait"] = [(step[0][0], forwards[0][0])] if forwards else []
    phases["other"] = _minus(step, _union([s for spans_ in phases.values() for s in spans_]))
    comm = _clip(_union(spans["comm"]), step)
    exposed = _minus(comm, _union(spans["compute"]))
    phases["optimizer_update"] = _clip(_union(spans.get("update", [])), step)  # inside optimizer, not a part
    phases["library"] = _clip(_union(spans.get("library", [])), _union(phases["forward"] + phases["backward"]))
    out = {f"{p}_s": (_length(x) - _length(_clip(exposed, x))) / 1e6 for p, x in phases.items()}
    out.update(comm_s=_length(comm) / 1e6, exposed_comm_s=_length(exposed) / 1e6, step_s=_length(step) / 1e6)
    return {key: out[key] for key in BREAKDOWN}


def mean_breakdown(timed: list[dict]) -> dict | None:
    """Mean per key over several timed steps (None when none was timed)."""
    if not timed:
        return None
    return {key: sum(t[key] for t in timed) / len(timed) for key in BREAKDOWN} | {"timed_steps": len(timed)}


def to_fields(timed: list[dict]) -> dict:
    """The mean breakdown of the timed steps as `RANK_FIELDS` floats (NaN: none timed)."""
    mean = mean_breakdown(timed)
    return {field: (mean[field.removeprefix("time_")] if mean else math.nan) for field in RANK_FIELDS}


def from_fields(rank: dict) -> dict | None:
    """A rank's `time_breakdown` from its gathered fields (None: not timed), with `timed_steps`."""
    values = {k: rank.get(f"time_{k}", math.nan) for k in BREAKDOWN}
    if any(v is None or math.isnan(v) for v in values.values()):
        return None
    return values | {"timed_steps": int(rank["time_timed_steps"])}


def across_ranks(breakdowns: list) -> dict | None:
    """The timed step across ranks: each rank's step time and busy time (step minus exposed communication), the
    busiest rank (most busy time: collectives make every rank's step last as long as the slowest, so the others
    show the difference as exposed waiting) and the spread of step times, (max - min) / mean; None unless every rank
    timed it. The summary's `straggler` starts from these (`stragglers.verdict`)."""
    if not breakdowns or any(b is None for b in breakdowns):
        return None
    steps = [b["step_s"] for b in breakdowns]
    busy = [b["step_s"] - b["exposed_comm_s"] for b in breakdowns]
    mean = sum(steps) / len(steps)
    return {"busiest_rank": max(range(len(busy)), key=busy.__getitem__), "step_s": steps, "busy_s": busy,
            "spread": (max(steps) - min(steps)) / mean if mean > 0 else 0.0}


# --- interval arithmetic on sorted, disjoint [(start, end)] lists ------------------------------------
def _union(spans) -> list:
    merged: list = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > start:
            merged.append((start, end))
    return merged


def _clip(spans: list, window: list) -> list:
    """The parts of `spans` inside `window` (both unions)."""
    out = []
    for start, end in spans:
        for w_start, w_end in window:
            lo, hi = max(start, w_start), min(end, w_end)
            if hi > lo:
                out.append((lo, hi))
    return _union(out)


def _minus(spans: list, holes: list) -> list:
    """The parts of `spans` outside `holes` (both unions)."""
    out = []
    for start, end in spans:
        cursor = start
        for h_start, h_end in holes:
            if h_end <= cursor or h_start >= end:
                continue
            if h_start > cursor:
                out.append((cursor, h_start))
            cursor = max(cursor, h_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def _length(spans: list) -> float:
    return sum(end - start for start, end in spans)
