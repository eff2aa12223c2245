"""`shardscope parity`'s two runs: the script under the config on N ranks (`accelerate launch`, or `deepspeed` for a
DeepSpeed JSON; fit/launching.py's commands), then the same script as one process with the same arguments. Both
record fingerprints (measure/parity_record.py: its environment variables are all the script gets from parity);
the reference trains the launched world's global batch (accumulation x N) on the same samples in the same order.

On a machine with no GPU the launched run is N gloo ranks in fp32 (the launcher's CPU overrides below) and so is the
reference; with GPUs, the launched run uses the config's precision and the reference one GPU at the same mixed
precision.
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ..configs.catalog import find_config
from ..errors import UsageError
from ..fit.launching import LOG_FILE, failure_reason, launch, launch_command
from ..measure.parity_record import PARITY_ENV, STEPS_ENV, WORLD_ENV
from ..safe_io import load_json, read_bytes

RECORDS = "parity"  # each run's fingerprints: RUN_DIR/parity/rank{R}.json
MAX_RECORD_BYTES = 256 << 20  # a check-sized model's fingerprints are well under this
LOG_TAIL_LINES = 25  # what a failed run's log shows


@dataclass
class RunConfig:
    """What the two runs are launched with."""

    path: Path
    launcher: str  # "accelerate" | "deepspeed"
    mixed_precision: str  # the config's: "no", "bf16", "fp16"
    deepspeed: bool  # an accelerate yaml of distributed_type DEEPSPEED takes precision from its DeepSpeed part
    fsdp1: bool


def read_config(value: str) -> RunConfig:
    """An accelerate yaml or a DeepSpeed JSON (a path or a shipped name); one line naming it when it is neither."""
    path = Path(value)
    if not path.exists():
        shipped = find_config(value)  # UsageError naming the shipped configs when it is none
        if shipped.kind not in ("accelerate", "deepspeed") or shipped.multinode:
            raise UsageError(f"--config {value}: parity launches on one machine under an accelerate yaml or a "
                             f"DeepSpeed JSON; '{shipped.name}' is a {'multi-node ' if shipped.multinode else ''}"
                             f"{shipped.kind} config")
        path = shipped.path
    from ..safe_io import load_data

    data = load_data(path, "--config")
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: not a mapping of settings")
    if path.suffix == ".json":
        if "zero_optimization" not in data and "train_batch_size" not in data and \
                "train_micro_batch_size_per_gpu" not in data:
            raise UsageError(f"--config {path}: a JSON config must be DeepSpeed's (zero_optimization, batch sizes)")
        precision = "bf16" if (data.get("bf16") or {}).get("enabled") is True else \
            "fp16" if (data.get("fp16") or {}).get("enabled") is True else "no"
        return RunConfig(path, "deepspeed", precision, True, False)
    if "distributed_type" not in data:
        raise UsageError(f"--config {path}: distributed_type: missing (not an accelerate config)")
    fsdp = data.get("fsdp_config") or {}
    return RunConfig(path, "accelerate", str(data.get("mixed_precision") or "no"),
                     data["distributed_type"] == "DEEPSPEED",
                     data["distributed_type"] == "FSDP" and str(fsdp.get("fsdp_version", 1)) == "1")


def launcher_overrides(config: RunConfig, gpus: int) -> list[str]:
    """On CPU, what the shipped GPU configs need to run as gloo ranks in fp32 (accelerate's own arguments)."""
    if config.launcher != "accelerate" or gpus:
        return ["--num_machines", "1", "--machine_rank", "0"] if config.launcher == "accelerate" else []
    flags = ["--num_machines", "1", "--machine_rank", "0"]
    if not config.deepspeed:
        flags += ["--mixed_precision", "no"]
    if config.fsdp1:  # FSDP1's rank-0 loading needs a device to broadcast from
        flags += ["--fsdp_cpu_ram_efficient_loading", "false", "--fsdp_sync_module_states", "false"]
    return flags


def run_env(folder: Path, steps: int, world: int | None = None, extra: dict | None = None) -> dict:
    env = dict(os.environ, **{PARITY_ENV: str(folder / RECORDS), STEPS_ENV: str(steps)}, **(extra or {}))
    if world:
        env[WORLD_ENV] = str(world)
    return env


def launch_both(script: Path, config: RunConfig, script_args: list[str], out: Path, ranks: int, steps: int,
                gpus: int) -> dict:
    """Launch the sharded run, then the reference; {name: (exit code, seconds, folder)}."""
    done = {}
    for name in ("launched", "reference"):
        folder = out / name
        shutil.rmtree(folder / RECORDS, ignore_errors=True)  # never read an earlier run's records
        if name == "launched":
            cmd = launch_command(config.launcher, str(script), config.path, list(script_args), folder,
                                 num_processes=ranks, launcher_args=launcher_overrides(config, gpus))
            env = run_env(folder, steps)
        else:
            cmd = [sys.executable, str(script), *script_args, "--output_dir", str(folder)]
            one_gpu = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
                       "ACCELERATE_MIXED_PRECISION": config.mixed_precision} if gpus else {}
            env = run_env(folder, steps, world=data_parallel(out / "launched", ranks), extra=one_gpu)
        code, seconds = launch(cmd, folder, env=env)
        done[name] = code, seconds, folder
        if code:
            break  # the reference of a run that failed says nothing
    return done


def data_parallel(folder: Path, ranks: int) -> int:
    """The launched run's data-parallel ranks (its record's; tensor parallel's ranks share batches), else `ranks`."""
    try:
        return int(load_json(folder / RECORDS / "rank0.json", "parity record", MAX_RECORD_BYTES).get("data_parallel")
                   or ranks)
    except (UsageError, ValueError, TypeError):
        return ranks  # no record: the comparison says so


def log_tail(folder: Path) -> str:
    """The last lines of a run's log, after its failure reason."""
    text = read_bytes(folder / LOG_FILE, "log", max_bytes=1 << 20, tail=True).decode(errors="replace")
    lines = text.rstrip().splitlines()[-LOG_TAIL_LINES:]
    return "\n".join([f"{folder.name} run failed: {failure_reason(text)}", *("  " + line for line in lines)])


def read_records(folder: Path, ranks: int) -> tuple[list[dict], str | None]:
    """Each rank's record of a finished run, or (what was read, why it is not complete)."""
    found = []
    for rank in range(ranks):
        path = folder / RECORDS / f"rank{rank}.json"
        if not path.exists():
            return found, (f"{folder.name} run wrote no parity record for rank {rank} ({path}): is "
                           f"ShardingProfilerCallback among the Trainer's callbacks?")
        record = load_json(path, "parity record", MAX_RECORD_BYTES)  # malformed: one line naming it
        if record.get("instrument", "ok") != "ok":
            return found, f"{folder.name} run, rank {rank}: the parity recorder failed: {record['instrument']}"
        found.append(record)
    return found, None
