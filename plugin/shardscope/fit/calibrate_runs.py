"""`shardscope calibrate`: the short profiled runs the step-time ranking needs, launched, and their figures kept.

From `fit`'s search, one candidate per library family that fits (DDP or ZeRO-1/2; DeepSpeed ZeRO-3; FSDP): the
fastest of the family's first strategy that fits (`FAMILIES` order), at its micro-batch and checkpointing, with
no accumulation. Each is launched with the shipped accelerate config of its strategy, one after the other, into
OUTPUT_DIR/<strategy>/ (log: launch.log); the script gets the Trainer's own arguments (`--output_dir`,
`--per_device_train_batch_size`, `--gradient_accumulation_steps 1`, `--gradient_checkpointing`, `--max_steps`),
so a recipe or any HfArgumentParser script that attaches ShardingProfilerCallback works. A run that fails is a
row with its log's last lines; the others go on. The figures each run measured
(`plan.calibration.run_dirs.run_sources`) are written to OUTPUT_DIR/calibration.json
(`plan.calibration.calibration_json`).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError
from ..configs.catalog import launcher_config
from .launching import LOG_FILE, MAX_LOG_BYTES, launch, launch_command, no_summary_reason
from ..plan.calibration.calibration_json import CALIBRATION_FILE, VERSION
from ..plan.calibration.run_dirs import run_sources
from ..safe_io import atomic_write_text, load_json, read_bytes
from ..strategy import strategy_from_summary
from ..summary import SUMMARY_FILE

# Library family -> its strategies, the one to run first where it fits.
FAMILIES = {"DDP or ZeRO-1/2": ("ddp", "zero2", "zero1"), "DeepSpeed ZeRO-3": ("zero3",),
            "FSDP": ("fsdp_full_shard", "fsdp_shard_grad_op")}
TAIL_LINES = 12


def choose_runs(fitting: list) -> list:
    """One fitting candidate per library family (`FAMILIES`), fastest of its first strategy that fits."""
    chosen = []
    for family, names in FAMILIES.items():
        for name in names:
            found = [c for c in fitting if c.strategy == name and c.tp == 1]
            if found:
                chosen.append((family, min(found, key=lambda c: c.step_time_s)))
                break
    return chosen


def script_arguments(cand, steps: int) -> list[str]:
    """The Trainer arguments a calibration run gets (after the user's own; the launcher adds --output_dir)."""
    return ["--per_device_train_batch_size", str(cand.per_device_train_batch_size),
            "--gradient_accumulation_steps", "1", "--gradient_checkpointing", str(cand.gradient_checkpointing).lower(),
            "--max_steps", str(steps)]


def run_one(script: Path, cand, family: str, args, output: Path, number: int, total: int, say) -> dict:
    """Launch one calibration run; its row for calibration.json (figures, or why it failed)."""
    run_dir = output / cand.strategy
    config = launcher_config(cand.strategy, "accelerate")
    cmd = launch_command("accelerate", str(script), config, [*args.script_args, *script_arguments(cand, args.steps)],
                         run_dir, launcher_args=args.launcher_args)
    say(f"[{number}/{total}] {family}: {cand.strategy}, micro-batch {cand.per_device_train_batch_size}, "
        f"checkpointing {'on' if cand.gradient_checkpointing else 'off'}, {args.steps} steps (log: {run_dir / LOG_FILE})")
    code, seconds = launch(cmd, run_dir)
    row = {"family": family, "strategy": cand.strategy, "config": str(config), "run_dir": str(run_dir),
           "log": str(run_dir / LOG_FILE), "exit_code": code, "seconds": round(seconds, 1)}
    log_text = read_bytes(run_dir / LOG_FILE, "launch log", MAX_LOG_BYTES, tail=True).decode(errors="replace")
    tail = log_text.splitlines()[-TAIL_LINES:]
    if code != 0 or not (run_dir / SUMMARY_FILE).is_file():
        reason = no_summary_reason(code, log_text)  # the log's last error, or that no summary was written
        say(f"      failed after {seconds:.0f} s: {reason}")
        return {**row, "status": "failed", "reason": reason, "log_tail": tail, "figures": []}
    try:
        ran = strategy_from_summary(load_json(run_dir / SUMMARY_FILE, "run summary"))
        if ran != cand.strategy:  # e.g. accelerate runs an FSDP config as DDP on CPU: not this family's figures
            raise UsageError(f"the run's profiler saw {ran}, not {cand.strategy}: its figures are not this family's")
        figures = [{"source": source, "figures": values} for source, values in run_sources(run_dir)]
    except UsageError as error:  # no timed step, or another strategy ran: reported, the others go on
        say(f"      finished in {seconds:.0f} s but measured nothing usable: {error}")
        return {**row, "status": "failed", "reason": str(error), "log_tail": tail, "figures": []}
    say(f"      done in {seconds:.0f} s")
    return {**row, "status": "ok", "figures": figures}


def calibrate_runs(script: Path, fitting: list, model: dict, precision: str, fingerprint: dict, args,
                   say=print) -> dict:
    """Launch the runs `choose_runs` picks, write OUTPUT_DIR/calibration.json; the document written."""
    chosen = choose_runs(fitting)
    if not chosen:
        raise UsageError("calibrate: no candidate of DDP, ZeRO-1/2, ZeRO-3 or FSDP fits: nothing to run")
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    runs = [run_one(script, cand, family, args, output, i, len(chosen), say)
            for i, (family, cand) in enumerate(chosen, 1)]
    doc = {"calibration_version": VERSION, "model": model, "precision": precision, "fingerprint": fingerprint,
           "runs": runs}
    atomic_write_text(output / CALIBRATION_FILE, json.dumps(doc, indent=1), "--output-dir")
    return doc
