"""How often a user's own 2-rank gloo script aborts at exit after a complete run, with and without the profiler.

The script is what a user writes: torch DDP on a tiny Llama for a few steps, optionally a `ShardingProfiler` with
its default instrumented steps, and at the end `dist.destroy_process_group()` and a plain interpreter exit (not
`shardscope.end_of_run()`). After a complete run gloo's threads can outlive the group and race
Python's finalization ("terminate called without an active exception"); the question is whether the profiler makes
that more likely (it should leave nothing behind at `close()`). Runs alternate between the two arms under
`torchrun`; an abort is a non-zero exit or that message after the script printed that it finished.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/exit_abort_rate.py --runs 20 --out benchmarks/results/exit_abort_rate.md
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the launch helpers the tests use
sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_docs.stamped: the measured-at line
from render_docs import stamped  # noqa: E402

from launch import BIN, cpu_env, free_port  # noqa: E402

MEASURES = ("plugin/shardscope/measure",)  # render_docs.stale: what the profiled arm runs

USER_SCRIPT = '''
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM
dist.init_process_group("gloo")
model = DDP(AutoModelForCausalLM.from_pretrained(sys.argv[1]))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
profiler = None
if sys.argv[2] == "profiled":
    from shardscope import ShardingProfiler
    profiler = ShardingProfiler(model, optimizer, output_dir=sys.argv[3], every_n_steps=2)
for step in range(6):
    batch = {"input_ids": torch.randint(3, 500, (2, 16)), "labels": torch.randint(3, 500, (2, 16))}
    model(**batch).loss.backward()
    optimizer.step(); optimizer.zero_grad()
    if profiler is not None:
        profiler.step(batch)
if profiler is not None:
    profiler.close()
dist.barrier()
dist.destroy_process_group()
print("FINISHED", flush=True)
'''


def run_once(script: Path, model: Path, arm: str, out: Path) -> bool:
    """True when the run finished and then aborted at exit."""
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port",
           str(free_port()), str(script), str(model), arm, str(out)]
    done = subprocess.run(cmd, env=cpu_env(), capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    if output.count("FINISHED") < 2:
        raise RuntimeError(f"the run did not finish ({arm}):\n{output[-3000:]}")
    return done.returncode != 0 or "terminate called" in output


def upper_bound(aborts: int, runs: int) -> float:
    """One-sided 95% upper bound of the abort rate (exact for 0 aborts: 1 - 0.05^(1/n); else Wilson's)."""
    if aborts == 0:
        return 1 - 0.05 ** (1 / runs)
    p, z = aborts / runs, 1.645
    centre = p + z * z / (2 * runs)
    spread = z * math.sqrt(p * (1 - p) / runs + z * z / (4 * runs * runs))
    return (centre + spread) / (1 + z * z / runs)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per arm")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arms", nargs="+", choices=("plain", "profiled"), default=["plain", "profiled"],
                        help="one arm alone checks the script works (one launch per run), not a result")
    args = parser.parse_args(argv)
    from shardscope.recipes.tiny import make_causal_lm

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_causal_lm(tmp / "model", "llama")
        script = tmp / "user_script.py"
        script.write_text(USER_SCRIPT)
        aborts = dict.fromkeys(args.arms, 0)
        for _ in range(args.runs):
            for arm in aborts:
                aborts[arm] += run_once(script, tmp / "model", arm, tmp / "out")
    load = os.getloadavg()[0]
    lines = [f"Exit aborts of a user's 2-rank gloo DDP script ending with `destroy_process_group()` "
             f"({args.runs} runs per arm, alternating; 1-min load average {load:.1f} at the end, on "
             f"{os.cpu_count()} CPU(s))", "", "| arm | runs | aborted after finishing | 95% upper bound of the rate |",
             "| --- | --- | --- | --- |"]
    lines += [f"| {arm} | {args.runs} | {n} | {upper_bound(n, args.runs):.1%} |" for arm, n in aborts.items()]
    arms = "" if len(args.arms) == 2 else " --arms " + " ".join(args.arms)
    lines += ["", f"command: `python benchmarks/exit_abort_rate.py --runs {args.runs}{arms}`"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(stamped("\n".join(lines) + "\n", __file__, MEASURES))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
