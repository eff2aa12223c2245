"""On one CUDA GPU, in one command: shardscope's CUDA paths held against the device -> results/gpu_check.md.

    python benchmarks/gpu_check.py              # ~4 min on one H100/H200 (make gpu-check)
    python benchmarks/gpu_check.py --dry-run    # what each check runs and compares (no GPU needed)
    python benchmarks/gpu_check.py --from-raw RAW.json   # the report again from a run's raw figures (no GPU)
    python benchmarks/gpu_check.py --from-raw RAW.json --replan   # ... with this tree's plans beside the run's

The llama-3.2-1b config (shipped, random weights), bf16 mixed precision, AdamW, random token ids (no padding), 10
optimizer steps per setting: micro-batch x sequence 2 x 1024 and 4 x 2048, each with and without activation
checkpointing, under the plain Trainer (one process), FSDP2 and ZeRO-3 (world size 1, NCCL, through `torchrun`,
with the shipped fsdp_configs/llama_full_shard.json and ds_configs/zero3.json): 12 runs in 6 processes
(`gpu_check_worker.py`; ZeRO-3 one setting per process: `ONE_PROCESS_EACH`). `shardscope plan` plans each setting beforehand. The checks are `CHECKS` below; each
prediction is compared with a measurement taken independently of the code that predicted it (the worker's `Probe`:
CUDA events and CUDA's allocator, reset each step). Raw figures go to `--raw` (JSON) beside the report, so a report
can be made again without the GPU. Where no CUDA device is present it says so in one line and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugin"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_check_report import OPTIMIZER, report  # noqa: E402

WORKER = ROOT / "benchmarks" / "gpu_check_worker.py"
MODEL = "llama-3.2-1b"
SETTINGS = [{"micro_batch": mb, "seq_len": seq, "checkpointing": ckpt}
            for mb, seq in ((2, 1024), (4, 2048)) for ckpt in (False, True)]
# worker strategy -> (the planner's row for it, launched by torchrun at world size 1)
STRATEGIES = {"plain": ("ddp", False), "fsdp2": ("fsdp_full_shard", True), "zero3": ("zero3", True)}
# DeepSpeed keeps each ZeRO-3 engine alive after its Trainer is gone (seen on the H200 and on CPU), so a ZeRO-3
# setting after the first would run beside the earlier ones' states: one process per setting there
ONE_PROCESS_EACH = {"zero3"}
FLIGHT_RECORDER = "fsdp2"  # the NCCL run whose flight-recorder ring is dumped and read by `shardscope hang`'s reader
MEASURES = ("benchmarks/gpu_check.py", "benchmarks/gpu_check_worker.py", "benchmarks/gpu_check_report.py",
            "plugin/shardscope/plan", "plugin/shardscope/measure", "plugin/shardscope/hang.py",
            "plugin/shardscope/profiling.py", "plugin/shardscope/units.py")
CHECKS = (
    ("1", "planner peak vs CUDA's allocator",
     "shardscope plan --json per setting (rows ddp, fsdp_full_shard, zero3)",
     "planned peak_bytes vs torch.cuda.max_memory_allocated over each step (less what was allocated before the "
     "model), the largest of steps 2-10; max_memory_reserved; the GPU-only terms the planner's headroom stands for "
     "(reserved - allocated, the CUDA context, NCCL's buffers, from NVML) against that headroom"),
    ("2", "the callback's peak by category",
     "ShardingProfilerCallback's instrumented memory step (3): peak_tensor_bytes and peak_breakdown",
     "against the allocator's peak of the same step 3; the callback's live plan (summary live_plan) against "
     "the run's measured peak"),
    ("3", "step time vs the datasheet prediction",
     "plan's step_time_s and parts (compute, optimizer, overhead); the callback's time breakdown of step 4",
     "the median CUDA-event span of the uninstrumented steps; with checkpointing the step-time ratio measured vs "
     "predicted (the model's recompute share, set from a published A100 figure: these runs are out of its sample)"),
    ("4", "cuda_compute's compute_s",
     "the summary's throughput.compute_seconds (CUDA events less the flight recorder's NCCL durations)",
     "an independent CUDA-event timing of the same steps (the profiler's window: instrumented steps left out)"),
    ("5", "MFU",
     "the summary's throughput.mfu (datasheet dense peak by device name)",
     "the FLOPs convention's count of the same steps over their CUDA-event time and the same datasheet peak"),
    ("6", "flight recorder on a one-rank NCCL group",
     "the FSDP2 run's ring, dumped as torch dumps it on a timeout (a pickle named for the rank)",
     "what shardscope hang's reader (shardscope.measure.hang.read_folder) reads from it; the JSON form's kinds and durations"),
)
TWO_GPUS = (
    ("torch context parallelism (fsdp_cp.yaml): losses vs one GPU, counted ring traffic, peak",
     "benchmarks/context_parallel_gpu.sh"),
    ("NCCL bus bandwidth per collective kind inside a node (the time model's link figures)",
     "shardscope preflight --output-dir OUT (on a node with 2+ GPUs; its preflight.json feeds plan --calibrate)"),
    ("DDP vs FSDP overlap: the time model's exposed communication against measured steps",
     "shardscope calibrate --model llama-3.2-1b --gpus 2 --global-batch 16 --recipe recipes/llama/demo_tiny.yaml, "
     "then shardscope plan --calibrate OUT/calibration.json"),
    ("a straggler's compute_s on 2 ranks (cuda_compute's docstring: rank 1 runs an extra matmul of known length)",
     "torchrun --nproc_per_node 2 on a script with ShardingProfilerCallback whose rank 1 runs the extra matmul; "
     "shardscope report OUT"),
    ("NCCL's dump on a real collective timeout read by shardscope hang",
     "a 2-rank run whose rank 1 stops before a collective (TORCH_NCCL_DUMP_ON_TIMEOUT=1 is set by the callback); "
     "shardscope hang OUT"),
)


def dry_run() -> str:
    lines = [f"gpu_check: on one CUDA GPU, model {MODEL} (random weights), bf16 mixed, AdamW, settings "
             + ", ".join(setting_name(s) for s in SETTINGS) + "; runs: "
             + ", ".join(f"{name} (plan row {row}{', torchrun, NCCL' if dist else ''})"
                         for name, (row, dist) in STRATEGIES.items())]
    for number, title, runs, compares in CHECKS:
        lines += [f"{number}. {title}", f"   runs: {runs}", f"   compares: {compares}"]
    lines.append("7. needs 2+ GPUs (not run here):")
    lines += [f"   - {what}: {command}" for what, command in TWO_GPUS]
    return "\n".join(lines)


def setting_name(setting: dict) -> str:
    return f"{setting['micro_batch']} x {setting['seq_len']}" + (", checkpointing" if setting["checkpointing"] else "")


def setting_key(setting: dict) -> str:
    return f"{setting['micro_batch']}x{setting['seq_len']}{'-ckpt' if setting['checkpointing'] else ''}"


def gpu_facts() -> dict:
    """The GPU's name, memory and driver from nvidia-smi (no CUDA context in this process)."""
    query = "name,memory.total,driver_version"
    done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=60)
    name, memory_mib, driver = [c.strip() for c in done.stdout.splitlines()[0].split(",")]
    return {"name": name, "memory_bytes": int(float(memory_mib)) * 2 ** 20, "driver": driver}


def planner_gpu(name: str) -> list[str]:
    """`plan`'s GPU arguments: the shipped GPU whose name the device's contains (its datasheet), longest first."""
    from shardscope.units import GPUS

    plain = name.lower().replace("-", " ")
    for key in sorted(GPUS, key=len, reverse=True):
        if key.lower().replace("-", " ") in plain:
            return ["--gpu", key]
    return ["--gpu-memory", str(gpu_facts()["memory_bytes"])]


def plan(setting: dict, gpu: list[str]) -> dict:
    command = [sys.executable, "-m", "shardscope", "plan", "--model", MODEL, "--gpus", "1", *gpu,
               "--precision", "bf16-mixed", "--optimizer", "adamw", "--micro-batch", str(setting["micro_batch"]),
               "--seq-len", str(setting["seq_len"]), *(["--checkpointing"] if setting["checkpointing"] else []),
               "--json"]
    done = subprocess.run(command, capture_output=True, text=True, env=child_env(), timeout=300)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return {"command": " ".join(command[1:]), **json.loads(done.stdout)}


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "plugin"), os.environ.get("PYTHONPATH", "")]),
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_worker(strategy: str, settings: list[dict], work: Path, steps: int, timeout_s: float) -> dict:
    """One worker process over `settings`; its JSON lines and, where it failed, its log's tail."""
    _, distributed = STRATEGIES[strategy]
    name = strategy + ("" if len(settings) > 1 else "-" + setting_key(settings[0]))
    out = work / f"{name}.jsonl"
    out.unlink(missing_ok=True)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1"] \
        if distributed else [sys.executable]
    command = [*launcher, str(WORKER), "--strategy", strategy, "--settings", json.dumps(settings),
               "--steps", str(steps), "--out", str(out),
               *(["--flight-recorder", str(work / "fr")] if strategy == FLIGHT_RECORDER else [])]
    log = work / f"{name}.log"
    started = time.monotonic()
    with log.open("w") as sink:
        try:
            code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, env=child_env(),
                                  timeout=max(timeout_s, 1)).returncode
        except subprocess.TimeoutExpired:
            code = f"timed out after {timeout_s:.0f} s"
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    tail = "" if code == 0 else "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    return {"strategy": strategy, "exit": code, "seconds": round(time.monotonic() - started, 1), "lines": lines,
            "log_tail": tail}


def jobs() -> list[tuple[str, list[dict]]]:
    """(strategy, its settings) per worker process, in order."""
    return [job for strategy in STRATEGIES
            for job in ([(strategy, [s]) for s in SETTINGS] if strategy in ONE_PROCESS_EACH else [(strategy, SETTINGS)])]


def versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "accelerate", "deepspeed"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    import torch

    out["cuda"] = torch.version.cuda
    return out


def commit(given: str | None) -> tuple[str, bool]:
    """(the commit measured, whether the measured paths differed from it): `--commit` where the tree has no .git
    (a copy sent to a GPU machine: whoever sent it vouches for it), else git's."""
    if given:
        return given, False
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", *MEASURES], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    return sha or "unknown (no git checkout)", bool(dirty)


def measure(args) -> dict:
    """Plans (in parallel, on the CPU) then the three workers one after another, within `args.budget_s`."""
    started, gpu = time.monotonic(), gpu_facts()
    sha, dirty = commit(args.commit)
    raw = {"gpu": gpu, "versions": versions(), "commit": sha, "dirty": dirty, "date": time.strftime("%Y-%m-%d"),
           "settings": SETTINGS, "steps": args.steps, "optimizer": OPTIMIZER, "strategies": {k: v[0] for k, v in STRATEGIES.items()}}
    with ThreadPoolExecutor(len(SETTINGS)) as pool:
        planned = list(pool.map(lambda s: plan(s, planner_gpu(gpu["name"])), SETTINGS))
    raw["plans"] = {setting_key(s): p for s, p in zip(SETTINGS, planned)}
    raw["plan_seconds"] = round(time.monotonic() - started, 1)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    raw["workers"], todo = [], jobs()
    for i, (strategy, settings) in enumerate(todo):
        left = args.budget_s - (time.monotonic() - started)
        share = left * len(settings) / sum(len(s) for _, s in todo[i:])  # the time left, by settings to run
        raw["workers"].append(run_worker(strategy, settings, work, args.steps, share))
        write_json(args.raw, raw)  # what finished is kept, whatever comes next
    raw["seconds"] = round(time.monotonic() - started, 1)
    return raw


def replan(raw: dict) -> dict:
    """The run's settings planned again by this tree here: {commit, versions, plans}."""
    gpu = planner_gpu(raw["gpu"]["name"])
    with ThreadPoolExecutor(2) as pool:
        plans = list(pool.map(lambda s: plan(s, gpu), raw["settings"]))
    sha, dirty = commit(None)
    return {"commit": sha, "dirty": dirty, "versions": versions(), "plans": dict(zip(map(setting_key, raw["settings"]),
                                                                                    plans))}


def write_json(path: Path, data: dict) -> None:
    from shardscope.safe_io import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=1, default=str), "raw figures")


def write_report(raw: dict, out: Path) -> None:
    """The report, stamped with the commit the raw figures were measured at (`render_docs`' stamp)."""
    from shardscope.safe_io import atomic_write_text

    text = report(raw, CHECKS, TWO_GPUS)
    if len(raw.get("commit", "")) == 40:
        dirty = " with uncommitted changes" if raw.get("dirty") else ""
        text = f"<!-- measured at: {raw['commit']}{dirty} by benchmarks/gpu_check.py -->\n{text}"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, text, "results")


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print what each check runs and compares, and exit")
    parser.add_argument("--from-raw", type=Path, metavar="RAW", help="write the report from a run's raw figures")
    parser.add_argument("--replan", action="store_true",
                        help="with --from-raw: plan each setting again with this tree (on this machine's CPU) and show "
                             "it beside the plans made on the GPU machine; the runs stay the measurement")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check.md")
    parser.add_argument("--raw", type=Path, help="the raw figures (JSON; default: beside --out, gpu_check.json)")
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "shardscope_gpu_check")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per setting (default 10)")
    parser.add_argument("--budget-s", type=float, default=420, help="seconds for the runs (default 420)")
    parser.add_argument("--commit", help="the commit this tree is (where the tree has no .git)")
    args = parser.parse_args(argv)
    args.raw = args.raw or args.out.with_suffix(".json")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.dry_run:
        print(dry_run())
        return 0
    if args.from_raw:
        from shardscope.safe_io import load_json

        raw = load_json(args.from_raw, "gpu_check raw figures", 64 * 2 ** 20)
        if args.replan:
            raw["replanned"] = replan(raw)
            write_json(args.raw, raw)
        write_report(raw, args.out)
        print(f"gpu_check: wrote {args.out}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); --dry-run shows what it would "
              "run", file=sys.stderr)
        return 2
    raw = measure(args)
    write_json(args.raw, raw)
    write_report(raw, args.out)
    failed = [w["strategy"] for w in raw["workers"] if w["exit"] != 0 or any("error" in x for x in w["lines"])]
    print(f"gpu_check: wrote {args.out} and {args.raw} in {raw['seconds']:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
