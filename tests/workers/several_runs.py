"""Run several training scripts one after another in one launched process, so that the launch (process start,
imports, process group) is paid once:

    accelerate launch ... tests/workers/several_runs.py --run NAME SCRIPT ARGS... [--run NAME SCRIPT ARGS...] \\
        --output_dir OUT

Each script runs unchanged as `__main__` (runpy) with its ARGS and `--output_dir OUT/NAME`; what each rank
prints meanwhile (file descriptors 1 and 2: libraries' output too) goes to `OUT/logs/NAME.rank{R}.log`. Before
each run accelerate's state is reset, so every Trainer builds its own (the process group stays), and the heap
left is frozen (gc.freeze); `end_of_run`
(which ends the process group, and on gloo the process) runs once, after the last run.
"""
import gc
import os
import runpy
import sys
from pathlib import Path

from accelerate.state import AcceleratorState

from shardscope.recipes import training


def parse(argv: list[str]) -> tuple[Path, list[tuple[str, str, list[str]]]]:
    """(OUT, [(NAME, SCRIPT, ARGS)]); OUT is the last `--output_dir` (the one the launch appends). Arguments before
    the first `--run` are the launcher's (the `deepspeed` launcher's `--local_rank=N`): every run gets them."""
    at = len(argv) - 1 - argv[::-1].index("--output_dir")
    output_dir, argv = Path(argv[at + 1]), argv[:at] + argv[at + 2:]
    first = argv.index("--run")
    groups: list[list[str]] = []
    for token in argv[first:]:
        if token == "--run":
            groups.append([])
        else:
            groups[-1].append(token)
    return output_dir, [(name, script, [*argv[:first], *args]) for name, script, *args in groups]


def run_one(script: str, args: list[str], log: Path) -> None:
    AcceleratorState._reset_state()
    # The last run's garbage collected, what is left is frozen (never scanned again): the full collections each
    # Trainer starts (accelerate's free_memory, DeepSpeed's) then scan this run's objects only.
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            sys.argv = [script, *args]
            runpy.run_path(script, run_name="__main__")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)


def main():
    output_dir, runs = parse(sys.argv[1:])
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)
    end_of_run, training.end_of_run = training.end_of_run, lambda: None  # the scripts' own call: not yet
    rank = os.environ.get("RANK", "0")
    for name, script, args in runs:
        run_one(script, [*args, "--output_dir", str(output_dir / name)], output_dir / "logs" / f"{name}.rank{rank}.log")
    end_of_run()


if __name__ == "__main__":
    main()
