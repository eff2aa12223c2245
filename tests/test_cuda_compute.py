"""A CUDA rank's compute time (measure/cuda_compute.py): the arithmetic from event pairs and flight-recorder entries.

No GPU here, so these are unit tests of a GPU-only branch's pure maths: `Event` stands in for a
`torch.cuda.Event(enable_timing=True)` (a GPU timestamp in ms, `query()` true once the stream reached it) and the
entries are dicts of the fields torch's flight recorder writes in its JSON form. Nothing of torch.distributed is
replaced: the code under test reads only these two kinds of objects. What a run on a GPU would check is in the
module's docstring.
"""
import json
import os
import time

import pytest
import torch

from shardscope.measure.cuda_compute import (LOST, PENDING, CudaCompute, Mark, TimingOff, oldest_kept, ring_entries,
                                             step_compute)


class Event:
    def __init__(self, gpu_ms: float, done: bool = True):
        self.gpu_ms, self.done = gpu_ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, other: "Event") -> float:
        assert self.done and other.done, "elapsed_time read before both events completed"
        return other.gpu_ms - self.gpu_ms


def nccl(created_ns: int, duration_ms: float | None, record_id: int = 0, name: str = "nccl:all_reduce") -> dict:
    entry = {"profiling_name": name, "time_created_ns": created_ns, "record_id": record_id,
             "retired": duration_ms is not None, "process_group": ["0", "default_pg"]}
    return entry | ({} if duration_ms is None else {"duration_ms": duration_ms})


def test_a_step_is_its_span_less_the_collectives_issued_inside_it():
    begin, end = Mark(Event(100.0), 1_000), Mark(Event(350.0), 2_000)
    entries = [nccl(900, 40.0),  # issued in the step before: not this step's
               nccl(1_200, 30.0), nccl(1_500, 20.0),
               nccl(1_600, 999.0, name="gloo:all_reduce"),  # CPU work of gloo: not on the GPU stream
               nccl(2_000, 50.0)]  # issued at the end mark: the next step's
    assert step_compute(begin, end, entries, None) == pytest.approx((250.0 - 30.0 - 20.0) / 1000)


def test_collectives_longer_than_the_span_leave_zero_not_less():
    """Two process groups' collectives running at once are both subtracted: capped at the span."""
    begin, end = Mark(Event(0.0), 0), Mark(Event(100.0), 10)
    assert step_compute(begin, end, [nccl(1, 70.0), nccl(2, 60.0)], None) == 0.0


def test_a_step_is_read_only_once_its_end_event_and_its_collectives_completed():
    begin = Mark(Event(0.0), 0)
    assert step_compute(begin, Mark(Event(10.0, done=False), 10), [], None) is PENDING
    unretired = [nccl(5, None) | {"retired": False}]
    assert step_compute(begin, Mark(Event(10.0), 10), unretired, None) is PENDING


def test_a_collective_retired_without_a_duration_means_timing_is_off():
    with pytest.raises(TimingOff, match="TORCH_NCCL_ENABLE_TIMING"):
        step_compute(Mark(Event(0.0), 0), Mark(Event(10.0), 10), [nccl(5, None) | {"retired": True}], None)


def test_a_step_older_than_the_rings_oldest_entry_is_lost_once_the_ring_wrapped():
    entries = [nccl(500, 1.0, record_id=7), nccl(600, 1.0, record_id=8)]
    assert oldest_kept(entries) == 500
    assert oldest_kept([nccl(500, 1.0, record_id=0)]) is None  # nothing overwritten yet
    assert step_compute(Mark(Event(0.0), 400), Mark(Event(5.0), 700), entries, 500) is LOST
    assert step_compute(Mark(Event(0.0), 500), Mark(Event(5.0), 700), entries, 500) == pytest.approx(0.003)


def test_steps_are_read_lazily_in_order_into_the_interval_and_the_run():
    """The steps' marks as the profiler records them (a paused step's gap left out); a step whose collectives are
    not retired yet holds itself and the steps after it until a later `collect`."""
    points = [(0.0, 0), (100.0, 100), (250.0, 200), (300.0, 300), (500.0, 400)]  # each mark's (GPU ms, CPU ns)
    ring = [nccl(50, 10.0), nccl(250, None) | {"retired": False}]
    timer = CudaCompute(mark=lambda: Mark(Event(points[0][0]), points.pop(0)[1]), entries=lambda: ring)
    timer.step_begin()  # 0 ms
    timer.step_end(pause_after=True)  # 100 ms: step 1, 10 ms of it in a collective
    timer.step_begin()  # 250 ms (the pause's 150 ms are no step's)
    timer.step_end()  # 300 ms: step 2, its collective not retired yet
    timer.step_end(count=False)  # 500 ms: an instrumented step, not counted
    timer.collect()
    assert (timer.interval, timer.run, len(timer.pending)) == (pytest.approx(0.090), pytest.approx(0.090), 1)
    timer.reset()
    ring[1] = nccl(250, 5.0)
    timer.collect()
    assert (timer.interval, timer.run, len(timer.pending), timer.lost) == (
        pytest.approx(0.045), pytest.approx(0.135), 0, 0)


def test_the_real_rings_entries_carry_the_fields_and_the_clock_read_here(tmp_path):
    """torch's flight recorder in its JSON form: the newest entry last, created on `time.time_ns`'s clock (a mark's),
    named by backend; gloo's CPU work is no GPU time, so a step over it keeps its whole span."""
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        before = time.time_ns()
        torch.distributed.all_reduce(torch.ones(2))
        after = time.time_ns()
        entries = ring_entries()
    finally:
        torch.distributed.destroy_process_group()
    assert entries[-1]["profiling_name"] == "gloo:all_reduce" and before <= entries[-1]["time_created_ns"] <= after
    span = (Mark(Event(0.0), before), Mark(Event(7.0), after + 1))
    assert step_compute(*span, entries, oldest_kept(entries)) == pytest.approx(0.007)


def test_nccl_timing_is_on_by_default_and_a_users_off_is_kept_and_said(monkeypatch):
    """Unset, shardscope turns NCCL's timing on; TORCH_NCCL_ENABLE_TIMING=0 set by the user: the profiler does not turn NCCL's timing back on; the figure is
    refused with the reason (the profiler's instrument warns it once)."""
    from shardscope.measure import collective_log
    from shardscope.measure.cuda_compute import enable_timing

    for name in collective_log.TIMING:
        monkeypatch.delenv(name, raising=False)
    collective_log.record_by_default()
    assert os.environ["TORCH_NCCL_ENABLE_TIMING"] == "1"  # on where the user set neither name
    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", "0")
    collective_log.record_by_default()
    assert os.environ["TORCH_NCCL_ENABLE_TIMING"] == "0"
    with pytest.raises(RuntimeError, match="TORCH_NCCL_ENABLE_TIMING=0"):
        enable_timing()


def test_the_rings_of_nccl_and_of_the_other_backends_are_both_read():
    """A CUDA build keeps NCCL's entries in a ring of its own (`_dump_nccl_trace_json`; seen on an H200, torch 2.11:
    the other dumper held none of an FSDP2 run's collectives): both are read, oldest first, an entry both return
    once. A stand-in for torch's c10d module: the NCCL dumper exists only in CUDA builds."""
    from types import SimpleNamespace

    from shardscope.measure.collective_log import ring_entries

    def dumper(entries):
        return lambda collectives, only_active: json.dumps({"entries": entries}).encode()

    nccl = [{"profiling_name": "nccl:all_gather", "record_id": 0, "time_created_ns": 30, "process_group": ["0", ""]},
            {"profiling_name": "nccl:reduce_scatter", "record_id": 1, "time_created_ns": 50,
             "process_group": ["0", ""]}]
    gloo = [{"profiling_name": "gloo:all_reduce", "record_id": 0, "time_created_ns": 40, "process_group": ["1", ""]}]
    both = SimpleNamespace(_dump_nccl_trace_json=dumper(nccl), _dump_fr_trace_json=dumper(gloo + nccl[:1]))
    assert [e["profiling_name"] for e in ring_entries(both)] == [
        "nccl:all_gather", "gloo:all_reduce", "nccl:reduce_scatter"]
    assert ring_entries(SimpleNamespace(_dump_fr_trace_json=dumper(gloo))) == gloo  # a CPU build: one ring
