"""`shardscope compare` (launch a recipe once per config, then report) and `shardscope report` arguments;
launching is fit/launching's, collecting and writing report/compare's."""
from __future__ import annotations

import os
import shlex
from pathlib import Path

from ..errors import UsageError
from ..configs.catalog import launcher_config
from ..fit.launching import CPU_LAUNCHER_ARGS, LOG_FILE, cpu_launch_problem, launch, launch_command, no_summary_reason
from ..plan.calibration.figures import measured_figures
from ..report.compare import outcome, write_report
from ..summary import SUMMARY_FILE
from .plan import add_calibrate_argument


def register(subparsers) -> None:
    cmp = subparsers.add_parser(
        "compare", help="run a recipe once per strategy config, then report memory and throughput side by side",
        description="Run RECIPE once per config (sequentially, OUTPUT_DIR/<config>/, log in launch.log), then "
                    "write the report. Arguments after -- go to the recipe. On a CPU machine pass the CPU "
                    f"overrides to the launcher: --launcher-args '{CPU_LAUNCHER_ARGS}'.",
        epilog="Exit status: 0 when every run succeeded, 1 when some failed (they are rows of the report, "
               "which is written all the same), 2 for a usage error.")
    cmp.add_argument("--recipe", required=True, type=Path, help="training script, e.g. recipes/causal_lm_sft.py")
    cmp.add_argument("--configs", required=True, nargs="+",
                     help="shipped config names (ddp, fsdp_full_shard, zero2, ...; `shardscope configs`) or files")
    cmp.add_argument("--launcher", choices=("accelerate", "deepspeed"), default="accelerate")
    cmp.add_argument("--num-processes", type=int, help="processes per node (default: the config's)")
    cmp.add_argument("--output-dir", type=Path, default=Path("compare_out"))
    cmp.add_argument("--launcher-args", default="", help="extra launcher arguments, one quoted string")
    cmp.add_argument("recipe_args", nargs="*", help="after --: the recipe's arguments (same for every run)")
    cmp.set_defaults(func=compare_command)
    rep = subparsers.add_parser("report", help="build the comparison report from existing run directories",
                                description="Each RUN_DIR holds a shardscope_summary.json (and optionally "
                                            "trainer_state.json); a folder of run folders works too.")
    rep.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    rep.add_argument("--output", type=Path, default=Path("shardscope_report"))
    rep.set_defaults(func=report_command)
    for parser in (cmp, rep):
        add_calibrate_argument(parser, " (default: the first run)")


def compare_command(args) -> int:
    if not args.recipe.is_file():
        raise UsageError(f"recipe '{args.recipe}' is not a file")
    if os.path.lexists(args.output_dir) and not args.output_dir.is_dir():
        raise UsageError(f"--output-dir '{args.output_dir}' exists and is not a folder")
    names = [Path(c).stem if Path(c).is_file() else c.replace("/", "_") for c in args.configs]
    if len(set(names)) != len(names):
        raise UsageError(f"--configs names a run twice: {' '.join(args.configs)}")
    measured = measured_figures(args.calibrate) if args.calibrate else None  # bad input: before any launch
    configs = [launcher_config(c, args.launcher) for c in args.configs]  # all resolved before the first launch
    extra = shlex.split(args.launcher_args)
    import torch

    problem = cpu_launch_problem(configs, args.launcher, args.num_processes, extra, torch.cuda.device_count())
    if problem:
        raise UsageError(problem)
    run_dirs = []
    for i, (name, config) in enumerate(zip(names, configs), 1):
        run_dir = args.output_dir / name
        (run_dir / SUMMARY_FILE).unlink(missing_ok=True)  # never report a previous run's summary
        cmd = launch_command(args.launcher, args.recipe, config, args.recipe_args, run_dir, args.num_processes, extra)
        print(f"[{i}/{len(configs)}] {name}: started (log: {run_dir / LOG_FILE})", flush=True)
        code, seconds = launch(cmd, run_dir)
        if code == 0 and (run_dir / SUMMARY_FILE).exists():
            print(f"[{i}/{len(configs)}] {name}: finished in {seconds:.1f} s", flush=True)
        else:
            reason = no_summary_reason(code, (run_dir / LOG_FILE).read_text(errors="replace"))
            print(f"[{i}/{len(configs)}] {name}: failed after {seconds:.1f} s: {reason}", flush=True)
        run_dirs.append(run_dir)
    return outcome(write_report(run_dirs, args.output_dir, measured), args.output_dir)


def report_command(args) -> int:
    measured = measured_figures(args.calibrate) if args.calibrate else None
    return outcome(write_report(args.run_dirs, args.output, measured), args.output)
