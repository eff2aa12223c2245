"""Run several training scripts one after another in one launched process, so that the launch (process start,
imports, process group) is paid once:

    accelerate launch ... tests/workers/several_runs.py [--launch_config YAML] --run NAME SCRIPT ARGS... \\
        [[--launch_config YAML] --run NAME SCRIPT ARGS...] --output_dir OUT

Each script runs unchanged as `__main__` (runpy) with its ARGS and `--output_dir OUT/NAME`; what each rank
prints meanwhile (file descriptors 1 and 2: libraries' output too) goes to `OUT/logs/NAME.rank{R}.log`. Before
each run accelerate's state is reset, so every Trainer builds its own (the process group stays), and the heap
left is frozen (gc.freeze); `end_of_run` (which ends the process group, and on gloo the process) runs once, after
the last run.

`--launch_config YAML` before a run: the run gets the environment `accelerate launch --config_file YAML` (with the
tests' CPU overrides) exports to its ranks, computed by accelerate's own launcher code
(shardscope.configs.launcher.launch_env), in place of the launch's: accelerate, the Trainer and DeepSpeed build that
config's plugin from it as in a launch of their own. The process group and accelerate's PartialState stay (a run of
another family builds its own AcceleratorState over them: seen, ZeRO-3 then DDP then FSDP in one launch, each holding
its own strategy's bytes; resetting PartialState as well made the DDP run train under DeepSpeed). The tests put DDP's
and FSDP's runs before DeepSpeed's, and keep the loop shapes' DeepSpeed runs apart (tests/loop_runs.py says why).
Each such run writes both environments to `OUT/logs/NAME.launch_env.rank{R}.json`, so a test can hold the computed
one equal to what the launcher exported (tests/launch.py launch_together does, for the launcher's own config).
"""
import gc
import json
import os
import runpy
import sys
from pathlib import Path

from accelerate.state import AcceleratorState

from shardscope.recipes import training

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: launch.accelerate_cpu_overrides
LAUNCH_ENV = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_")  # what the launcher exports of a config


def parse(argv: list[str]) -> tuple[Path, list[tuple[str, str, list[str], str | None]]]:
    """(OUT, [(NAME, SCRIPT, ARGS, LAUNCH_CONFIG or None)]); OUT is the last `--output_dir` (the one the launch
    appends). Arguments before the first `--run` or `--launch_config` are the launcher's (the `deepspeed` launcher's
    `--local_rank=N`): every run gets them."""
    at = len(argv) - 1 - argv[::-1].index("--output_dir")
    output_dir, argv = Path(argv[at + 1]), argv[:at] + argv[at + 2:]
    first = min(argv.index(marker) for marker in ("--run", "--launch_config") if marker in argv)
    runs, config, tokens = [], None, iter(argv[first:])
    for token in tokens:
        if token == "--launch_config":
            config = next(tokens)
        elif token == "--run":
            runs.append([next(tokens), next(tokens), list(argv[:first]), config])
            config = None
        else:
            runs[-1][2].append(token)
    return output_dir, [tuple(run) for run in runs]


def launched_with(config: str, record: Path) -> None:
    """This process's environment as `accelerate launch --config_file CONFIG` sets it (module docstring)."""
    from launch import accelerate_cpu_overrides
    from shardscope.configs.launcher import launch_args, launch_env

    # the launcher passes its own environment on: computed from this one without the launch's (or a run's) variables
    before = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith(LAUNCH_ENV)}
    exported = launch_env(launch_args(config, *accelerate_cpu_overrides(config, int(os.environ["WORLD_SIZE"]))))
    exported = {k: v for k, v in exported.items() if k.startswith(LAUNCH_ENV)}
    os.environ.update(exported, **{k: v for k, v in before.items() if k == "ACCELERATE_USE_CPU"})  # the tests' own
    record.write_text(json.dumps({"launched": before, "computed": exported}))


def run_one(script: str, args: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)  # a NAME may hold a folder: CONFIG/NAME
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
    for name, script, args, config in runs:
        if config:
            (output_dir / "logs" / name).parent.mkdir(parents=True, exist_ok=True)
            launched_with(config, output_dir / "logs" / f"{name}.launch_env.rank{rank}.json")
        run_one(script, [*args, "--output_dir", str(output_dir / name)], output_dir / "logs" / f"{name}.rank{rank}.log")
    end_of_run()


if __name__ == "__main__":
    main()
