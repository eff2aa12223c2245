"""What `shardscope parity` costs beside the two runs it launches, on the tiny Llama (tests/strategy_runs.py's
shard_llama) for 3 steps on 2 CPU ranks.

Arm "parity": `shardscope parity --config CONFIG --script tests/workers/train_tiny.py --steps 3` end to end (its
start, the launched run, the reference, the fingerprints recorded and compared). Arm "two runs": the same two
commands without parity (the launched run under `accelerate launch`, the one-process run with the accumulation
parity gives it), each timed as a process. The arms alternate; the row keeps the median of each and their ratio.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/parity_cost.py --repeats 3
        # -> benchmarks/results/parity_cost.md
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the launch helpers the tests use
sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_docs: the measured-at line, the machine
from render_docs import git, machine, stamped  # noqa: E402

from launch import BIN, cpu_env, free_port  # noqa: E402

MEASURES = ("plugin/shardscope/parity", "plugin/shardscope/measure", "plugin/shardscope/cli/parity.py")
SCRIPT = ROOT / "tests" / "workers" / "train_tiny.py"
STEPS = 3
ARGS = ["--per_device_train_batch_size", "2", "--report_to", "none", "--save_strategy", "no", "--use_cpu",
        "--max_steps", str(STEPS)]
HEADER = ("| date | commit | machine | config | steps | parity s | two runs s | ratio |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")


def timed(cmd: list[str], env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1) or "shardscope parity: diverged" in done.stdout:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return seconds


def arms(model: Path, config: str, out: Path) -> dict[str, float]:
    env, args = cpu_env(), [*ARGS, "--model", str(model)]
    parity = timed([sys.executable, "-m", "shardscope", "parity", "--config", config, "--script", str(SCRIPT),
                    "--steps", str(STEPS), "--output-dir", str(out / "parity"), "--", *args], env)
    launched = timed([str(BIN / "accelerate"), "launch", "--config_file",
                      str(ROOT / "accelerate_configs" / f"{config}.yaml"), "--num_processes", "2", "--num_machines",
                      "1", "--machine_rank", "0", "--mixed_precision", "no", "--main_process_port", str(free_port()),
                      str(SCRIPT), *args, "--output_dir", str(out / "launched")], env)
    reference = timed([sys.executable, str(SCRIPT), *args, "--gradient_accumulation_steps", "2", "--output_dir",
                       str(out / "reference")], env)
    return {"parity": parity, "two runs": launched + reference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", default="ddp")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "parity_cost.md")
    args = parser.parse_args()
    from shardscope.recipes.tiny import make_causal_lm

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_causal_lm(model, "llama", vocab_size=1600, intermediate_size=1600)
        seen = [arms(model, args.config, Path(tmp) / f"r{i}") for i in range(args.repeats)]
    parity, plain = (statistics.median(s[arm] for s in seen) for arm in ("parity", "two runs"))
    commit = (git("rev-parse", "--short=10", "HEAD", root=ROOT) or "-").strip()
    row = (f"| {datetime.date.today()} | {commit} | {machine()} | {args.config} | {STEPS} | {parity:.1f} | "
           f"{plain:.1f} | {parity / plain:.2f} |")
    old = args.out.read_text().splitlines() if args.out.exists() else []
    rows = [line for line in old if line.startswith("| 20")]
    text = (f"`shardscope parity` beside the two runs it launches, tiny Llama (shard_llama), {STEPS} steps, 2 CPU "
            f"ranks; medians of {args.repeats} alternating repeats (1-min load average {os.getloadavg()[0]:.1f} at "
            f"the end)\n\n{HEADER}\n" + "\n".join([*rows, row]) + "\n\ncommand: `python benchmarks/parity_cost.py "
            f"--repeats {args.repeats}`\n")
    args.out.write_text(stamped(text, __file__, MEASURES))
    print(text)


if __name__ == "__main__":
    main()
