"""`shardscope calibrate`: fit's search, then one short profiled run per library family that fits, their figures in
calibration.json for `fit`/`plan --calibrate` (the runs: fit/calibrate_runs.py)."""
from __future__ import annotations

import os
import shlex
from pathlib import Path

from ..errors import UsageError
from ..configs.catalog import launcher_config
from ..fit.calibrate_runs import calibrate_runs
from ..fit.launching import cpu_launch_problem
from ..plan.calibration.calibration_json import CALIBRATION_FILE, this_machine
from .fit import add_search_arguments, nothing_fits_lines, searched


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "calibrate", help="measure the step-time model's figures here: one short profiled run per library family",
        description="Search as `fit` does, then launch the recipe (or your script) once per library family that "
                    "fits (DDP or ZeRO-1/2, ZeRO-3, FSDP) at that candidate's micro-batch and checkpointing for a "
                    f"few steps, and write OUTPUT_DIR/{CALIBRATION_FILE}; rank with `fit --calibrate "
                    f"OUTPUT_DIR/{CALIBRATION_FILE}`. Arguments after -- go to the script (docs/fit.md).",
        epilog="Exit status: 0 every run measured, 1 a run failed (the others are kept) or nothing fits, "
               "2 bad input.")
    add_search_arguments(p)
    run = p.add_argument_group("runs")
    script = run.add_mutually_exclusive_group(required=True)
    script.add_argument("--recipe", type=Path, help="a shardscope recipe, e.g. recipes/causal_lm_sft.py")
    script.add_argument("--script", type=Path, help="your own training script: it must take the Trainer's "
                                                    "arguments and attach ShardingProfilerCallback")
    run.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8; at least 6)")
    run.add_argument("--launcher-args", default="", help="extra `accelerate launch` arguments, one quoted string "
                                                         "(on CPU: '--num_processes 2 --mixed_precision no')")
    run.add_argument("--output-dir", type=Path, default=Path("calibration_out"))
    run.add_argument("script_args", nargs="*", help="after --: the script's own arguments (same for every run)")
    p.set_defaults(func=calibrate_command)


def calibrate_command(args) -> int:
    script = args.recipe or args.script
    if not script.is_file():
        raise UsageError(f"{'--recipe' if args.recipe else '--script'} '{script}' is not a file")
    if args.steps < 6:
        raise UsageError(f"--steps must be at least 6 (a timed step and plain steps to take the median of), got "
                         f"{args.steps}")
    if os.path.lexists(args.output_dir) and not args.output_dir.is_dir():
        raise UsageError(f"--output-dir '{args.output_dir}' exists and is not a folder")
    args.launcher_args = shlex.split(args.launcher_args)
    spec, setup, _, _, _, found, traces = searched(args, assume_gpu=True)
    if not found["fitting"]:
        print("\n".join(nothing_fits_lines(spec, setup, found, args, traces)))
        return 1
    import torch

    configs = [launcher_config(c.strategy, "accelerate") for c in found["fitting"]]
    problem = cpu_launch_problem(configs, "accelerate", None, args.launcher_args, torch.cuda.device_count())
    if problem:
        raise UsageError(problem)
    model = {"name": spec.name, "params_total": spec.params_total, "trainable_params": found["model"]["trainable_params"]}
    doc = calibrate_runs(script, found["fitting"], model, setup.precision, this_machine(), args)
    ok = [r for r in doc["runs"] if r["status"] == "ok"]
    print(f"\n{len(ok)} of {len(doc['runs'])} runs measured; written {args.output_dir / CALIBRATION_FILE}")
    if ok:
        print(f"rank with: shardscope fit ... --calibrate {args.output_dir / CALIBRATION_FILE}")
    for r in doc["runs"]:
        if r["status"] != "ok":
            print(f"failed: {r['strategy']} ({r['reason']}); last lines of {r['log']}:",
                  *(f"  {line}" for line in r["log_tail"]), sep="\n")
    return 0 if len(ok) == len(doc["runs"]) else 1
