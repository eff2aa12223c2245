"""What the hang forensics cost: torch's flight recorder per collective (ring on vs off), and the profiler's
per-step additions (the watchdog's `step_done`, the compute clock), on this machine.

Part 1 launches itself under `torchrun --nproc_per_node 2` (gloo, 2 CPU ranks) once per arm, the arms alternating
(off, on, on, off, ...: `--pairs` pairs): each launch times `--collectives` all_reduces of 256 floats (1 KiB) and
of 256 Ki floats (1 MiB) on rank 0, in 10 windows, after a warm-up; the arm is the median window's time per
call. Arm "ring off": `TORCH_FR_BUFFER_SIZE=0`; arm "ring on": 2000 entries (what shardscope sets where you set
nothing, and torch 2.13's own default). Part 2 times, in this process, the calls the profiler adds to every
optimizer step: `Watchdog.step_done` and the two `time.thread_time()` reads of the compute clock.
    OMP_NUM_THREADS=1 python benchmarks/hang_overhead.py                 # ~1 min -> results/hang_overhead.md
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_docs.stamped: the measured-at line
from render_docs import stamped  # noqa: E402

OUT = Path(__file__).parent / "results" / "hang_overhead.md"
MEASURES = ("plugin/shardscope/measure/watchdog.py", "plugin/shardscope/measure/collective_log.py",
            "plugin/shardscope/measure/stragglers.py")  # render_docs.stale
PLUGIN = Path(__file__).resolve().parents[1] / "plugin"
SIZES = {"1 KiB": 256, "1 MiB": 256 * 1024}  # float32 elements


def worker(collectives: int, out: str) -> None:
    """Under torchrun: time all_reduces per size; rank 0 writes {size: seconds per call}."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    result = {}
    for name, n in SIZES.items():
        tensor = torch.ones(n)
        for _ in range(20):
            dist.all_reduce(tensor)
        per_window = max(1, collectives // 10)
        windows = []
        for _ in range(10):
            start = time.perf_counter()
            for _ in range(per_window):
                dist.all_reduce(tensor)
            windows.append((time.perf_counter() - start) / per_window)
        result[name] = statistics.median(windows)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def launch(ring: int, collectives: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": str(ring),
               "PYTHONPATH": str(PLUGIN)}
        env.pop("TORCH_NCCL_TRACE_BUFFER_SIZE", None)
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--standalone",
               __file__, "--worker", "--collectives", str(collectives), "--result", str(out)]
        subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
        return json.loads(out.read_text())


def per_step_calls(number: int) -> dict:
    """Seconds per call of what the profiler adds to each step (part 2)."""
    sys.path.insert(0, str(PLUGIN))
    from shardscope.measure.guard import Instrument, WarnOnce
    from shardscope.measure.watchdog import Watchdog

    dog = Watchdog(tempfile.gettempdir(), "auto", Instrument("watchdog", WarnOnce()))  # not started: no thread
    step_done = min(timeit.repeat(lambda: dog.step_done(1), number=number, repeat=5)) / number
    clock = min(timeit.repeat(time.thread_time, number=number, repeat=5)) / number
    return {"Watchdog.step_done": step_done, "compute clock (2 x time.thread_time)": 2 * clock}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--collectives", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.collectives, args.result)
    started, arms = time.time(), {0: [], 2000: []}
    for pair in range(args.pairs):
        for ring in ((0, 2000) if pair % 2 == 0 else (2000, 0)):
            arms[ring].append(launch(ring, args.collectives))
    rows = ["| all_reduce of | ring off (us/call) [launches' range] | ring on, 2000 entries (us/call) [range] | on / off |",
            "|---|---|---|---|"]
    for name in SIZES:
        off, on = ([r[name] * 1e6 for r in arms[ring]] for ring in (0, 2000))
        rows.append(f"| {name} | {statistics.median(off):.1f} [{min(off):.0f}-{max(off):.0f}] | "
                    f"{statistics.median(on):.1f} [{min(on):.0f}-{max(on):.0f}] | "
                    f"{statistics.median(on) / statistics.median(off):.3f} |")
    calls = per_step_calls(20000)
    rows += ["", "| added to every optimizer step | us/call |", "|---|---|"]
    rows += [f"| {name} | {seconds * 1e6:.3f} |" for name, seconds in calls.items()]
    import torch

    text = "\n".join([
        "# Hang forensics: what they cost", "", *rows, "",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}; command: `python benchmarks/hang_overhead.py"
        f"{' ' + ' '.join(argv) if argv else ''}`; wall: {time.time() - started:.0f} s",
        f"- machine: {platform.platform()}, {os.cpu_count()} CPUs; torch {torch.__version__}; 2 gloo ranks under "
        "`torchrun`, 1 torch thread each; rank 0's calls",
        f"- method: {args.pairs} pairs of launches, arms alternating; per launch the median of 10 windows of "
        f"{max(1, args.collectives // 10)} calls after 20 warm-up calls; per arm the median over its launches. "
        "Per-step calls: the best of 5 repeats of 20,000 calls in one process (the watchdog's thread not started: "
        "it wakes every 0.5 s and writes to the store only when the step changed).", ""])
    args.out.write_text(stamped(text, __file__, MEASURES))
    print(text)


if __name__ == "__main__":
    main()
