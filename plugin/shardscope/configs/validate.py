"""`validate_config`: a config file's kind (`guess_kind`), then its check by the library that consumes it
(accelerate's config classes and launcher, DeepSpeed's parser after the Trainer's "auto" filling,
`TrainingArguments`, bash for a SLURM script); every problem reported as `FILE: KEY: what is wrong`."""
from __future__ import annotations

import subprocess
from pathlib import Path

from ..errors import UsageError
from .accelerate import validate_accelerate
from .catalog import FOLDERS, KINDS
from .deepspeed import validate_deepspeed_file
from .files import ConfigProblems, config_text, json_object
from .fsdp import validate_fsdp


def validate_config(path, kind: str | None = None, world_size: int = 8):
    """Load `path` with the library that consumes it and check what that library does not.

    Returns the loaded object (accelerate `ClusterConfig`, DeepSpeed `DeepSpeedConfig`,
    `TrainingArguments`, or the SLURM script's text); raises `ConfigProblems` (a `UsageError`)
    naming the file and key of every problem found. `world_size` is used for DeepSpeed JSON only
    (an accelerate yaml gives its own `num_processes`).
    """
    path = Path(path)
    config_text(path)  # refuses missing, special, oversized, binary and non-UTF-8 files before any library reads them
    kind = kind or guess_kind(path)
    if kind not in KINDS:
        raise UsageError(f"{path}: unknown config kind '{kind}' (one of {', '.join(KINDS)})")
    check = {"accelerate": validate_accelerate, "deepspeed": validate_deepspeed_file,
             "fsdp": validate_fsdp, "slurm": _validate_slurm}[kind]
    problems: list[str] = []
    loaded = check(path, problems, world_size)
    if problems:
        raise ConfigProblems([p if p.startswith(str(path)) else f"{path}: {p}" for p in problems])
    return loaded


def guess_kind(path: Path) -> str:
    """A config file's kind from its suffix, folder or keys."""
    if path.suffix in (".sbatch", ".sh"):
        return "slurm"
    if path.suffix in (".yaml", ".yml"):
        return "accelerate"
    for folder, (suffixes, _) in FOLDERS.items():
        if path.parent.name == folder and path.suffix in suffixes:
            return suffixes[path.suffix]
    config = json_object(path)
    if "distributed_type" in config:
        return "accelerate"
    return "deepspeed" if {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu"} & set(config) else "fsdp"


def _validate_slurm(path: Path, problems: list[str], world_size: int):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    problems += [line for line in result.stderr.splitlines() if line.strip()]
    return path.read_text()
