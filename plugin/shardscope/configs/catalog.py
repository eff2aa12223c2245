"""The shipped config collection (the package's data/ folder): each file's name, kind and description, a name or
path resolved to a file (`find_config`, `resolve_config`), the file a launcher reads (`launcher_config`)."""
from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError
from ..strategy import RECORDS

DATA = Path(__file__).resolve().parents[1] / "data"
# folder -> (kind by file suffix, prefix of the qualified name)
FOLDERS = {
    "accelerate_configs": ({".yaml": "accelerate", ".sbatch": "slurm"}, ""),
    "ds_configs": ({".json": "deepspeed"}, "ds/"),
    "fsdp_configs": ({".json": "fsdp"}, "fsdp/"),
}
KINDS = ("accelerate", "deepspeed", "fsdp", "slurm")


@dataclass(frozen=True)
class ShippedConfig:
    name: str  # qualified name: "zero3" (accelerate yaml), "ds/zero3", "fsdp/llama_full_shard", "slurm_multinode"
    kind: str  # "accelerate" | "deepspeed" | "fsdp" | "slurm"
    path: Path
    description: str
    multinode: bool


def shipped_configs() -> list[ShippedConfig]:
    """Every config shipped in the package's data/ folder, accelerate yamls first."""
    found = []
    for folder, (suffixes, prefix) in FOLDERS.items():
        for path in sorted((DATA / folder).rglob("*")):
            kind = suffixes.get(path.suffix)
            if kind and path.is_file():
                found.append(_describe(path.resolve(), kind, prefix + path.stem))
    return found


def _describe(path: Path, kind: str, name: str) -> ShippedConfig:
    text = path.read_text()
    if kind in ("deepspeed", "fsdp"):
        config = json.loads(text)
        description = config.get("_comment", "").split(". ")[0].rstrip(".")
        multinode = False  # a JSON holds no node count; the multi-node layouts ship as launcher yamls
    else:
        comments = [line.lstrip("#").strip() for line in text.splitlines()
                    if line.startswith("#") and not line.startswith(("#!", "#SBATCH"))]
        first = next((i for i, line in enumerate(comments) if line.endswith(".")), len(comments) - 1)
        # the first sentence, over as many lines as it takes
        description = re.split(r"(?<=\.)\s", " ".join(comments[:first + 1]), maxsplit=1)[0]
        multinode = kind == "slurm" or _num_machines(text) > 1
    return ShippedConfig(name, kind, path, description, multinode)


def _num_machines(yaml_text: str) -> int:
    import yaml

    return int((yaml.safe_load(yaml_text) or {}).get("num_machines", 1))


def find_config(name: str) -> ShippedConfig:
    """Resolve a config name: the qualified name (`zero3` is the accelerate yaml, `ds/zero3`,
    `fsdp/llama_full_shard`), a file name (`zero3.yaml`, `zero3.json`) or folder/file
    (`ds_configs/zero3.json`). `deepspeed/` is accepted for `ds/`."""
    configs = shipped_configs()
    wanted = name.strip().removeprefix("./")
    if wanted.startswith("deepspeed/"):
        wanted = "ds/" + wanted.removeprefix("deepspeed/")
    for config in configs:
        if wanted in (config.name, config.path.name, f"{config.path.parent.name}/{config.path.name}"):
            return config
    # a file name shared by two folders (none today) would match its first folder, accelerate first
    candidates = [c.name for c in configs] + [c.path.name for c in configs]
    close = difflib.get_close_matches(wanted, candidates, n=4, cutoff=0.5)
    hint = f"; did you mean: {', '.join(close)}?" if close else ""
    raise UsageError(f"unknown config '{name}'{hint} (`shardscope configs` lists them all)")


def resolve_config(value, kind: str) -> Path | None:
    """A path, or a shipped config name (`zero3`, `ds/zero3`, `fsdp/llama_full_shard`) of that kind."""
    if value is None or os.path.lexists(value):  # any existing path: the reader says what is wrong with it
        return None if value is None else Path(value)
    wanted = str(value)
    if kind == "deepspeed" and not wanted.startswith(("ds/", "deepspeed/", "ds_configs/")):
        wanted = "ds/" + wanted
    if kind == "fsdp" and not wanted.startswith(("fsdp/", "fsdp_configs/")):
        wanted = "fsdp/" + wanted
    try:
        config = find_config(wanted)
    except UsageError as error:
        raise UsageError(f"config file '{value}' does not exist and is not a shipped {kind} config "
                         f"({str(error).partition('; ')[2] or 'shardscope configs lists them'})") from None
    if config.kind != kind:
        raise UsageError(f"'{value}' is a shipped {config.kind} config, not a {kind} one")
    return config.path


def launcher_config(name: str, launcher: str) -> Path:
    """The config file `launcher` reads: a path, or a shipped name of its kind (`zero3`: the accelerate yaml for
    `accelerate launch`, ds/zero3 for `deepspeed`)."""
    if launcher == "accelerate":
        return resolve_config(name, "accelerate")
    try:
        return resolve_config(name, "deepspeed")
    except UsageError:
        shipped = ", ".join(r.library_config.removeprefix("ds/") for r in RECORDS if r.library_config)
        raise UsageError(f"--launcher deepspeed needs a DeepSpeed JSON config: '{name}' is not one of the shipped "
                         f"ds/ configs ({shipped}) nor a file") from None
