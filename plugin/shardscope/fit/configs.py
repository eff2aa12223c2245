"""The shipped config collection: catalogue, look-up and validation (the command is cli/configs.py).

Each config is validated by the library that consumes it (accelerate's config classes and launcher,
DeepSpeed's config parser after the Trainer's "auto" filling, `TrainingArguments`), plus the checks those
libraries skip: nested `fsdp_config`/`deepspeed_config` keys, keys a library never reads, numbers
written as strings. Every problem is reported as `FILE: KEY: what is wrong`.
"""
from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from ..errors import UsageError
from ..safe_io import parse_json, parse_yaml, read_text
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


class ConfigProblems(UsageError):
    """One or more problems in config files; `problems` holds one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("; ".join(problems))


# ----------------------------------------------------------------------------- catalogue


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


# ----------------------------------------------------------------------------- validation


def validate_config(path, kind: str | None = None, world_size: int = 8):
    """Load `path` with the library that consumes it and check what that library does not.

    Returns the loaded object (accelerate `ClusterConfig`, DeepSpeed `DeepSpeedConfig`,
    `TrainingArguments`, or the SLURM script's text); raises `ConfigProblems` (a `UsageError`)
    naming the file and key of every problem found. `world_size` is used for DeepSpeed JSON only
    (an accelerate yaml gives its own `num_processes`).
    """
    path = Path(path)
    _text(path)  # refuses missing, special, oversized, binary and non-UTF-8 files before any library reads them
    kind = kind or guess_kind(path)
    if kind not in KINDS:
        raise UsageError(f"{path}: unknown config kind '{kind}' (one of {', '.join(KINDS)})")
    check = {"accelerate": _check_accelerate, "deepspeed": _check_deepspeed_file,
             "fsdp": _check_fsdp, "slurm": _check_slurm}[kind]
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
    config = _load_json(path)
    if "distributed_type" in config:
        return "accelerate"
    return "deepspeed" if {"zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu"} & set(config) else "fsdp"


class _ReadTracker(dict):
    """A dict that records which keys its reader asked for, to find keys a library silently ignores."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read = set()

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.read.add(key)
        return super().__contains__(key)

    def setdefault(self, key, default=None):
        self.read.add(key)
        return super().setdefault(key, default)

    def pop(self, key, *default):
        self.read.add(key)
        return super().pop(key, *default)

    def unread(self) -> list[str]:
        return sorted(k for k in self if k not in self.read and not str(k).startswith("_"))


def _text(path: Path) -> str:
    try:
        return read_text(path)
    except UsageError as error:
        raise ConfigProblems([str(error)]) from None


def _parsed(path: Path, parse) -> object:
    """`parse` (safe_io's bounded JSON/YAML) of the file, its errors as `ConfigProblems` naming FILE:LINE:COL."""
    try:
        return parse(_text(path), str(path))
    except ConfigProblems:
        raise
    except UsageError as error:
        raise ConfigProblems([str(error)]) from None


def _load_json(path: Path) -> dict:
    config = _parsed(path, parse_json)
    if not isinstance(config, dict):
        raise ConfigProblems([f"{path}: the top level must be a JSON object, not {type(config).__name__}"])
    return config


def strings_that_should_be_values(config, prefix="") -> list[str]:
    """Keys whose value is a number or boolean written as a string (libraries compare or coerce them silently)."""
    found = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found += strings_that_should_be_values(value, name + ".")
        elif isinstance(value, str) and value != "auto" and not str(key).startswith("_"):
            if value.strip().lower() in ("true", "false") or _is_number(value):
                found.append(f"{name}: {value!r} is a string; write it without quotes (or \"auto\")")
    return found


def not_mappings(config: dict, sections) -> list[str]:
    """Dotted `sections` that are present but not mappings (libraries call .get on them and crash)."""
    found = []
    for dotted in sections:
        parent, _, key = dotted.rpartition(".")
        holder = _dig(config, parent) if parent else config
        value = holder.get(key) if isinstance(holder, dict) else None
        if value is not None and not isinstance(value, dict):
            found.append(f"{dotted}: expected a mapping of keys to values, got {value!r}")
    return found


def _dig(config, dotted: str):
    for part in dotted.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


# --- DeepSpeed JSON

# sections the Trainer and DeepSpeed read keys from (a number there crashes them instead of being reported)
DEEPSPEED_SECTIONS = ("zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
                      "optimizer", "optimizer.params", "scheduler", "scheduler.params", "bf16", "fp16")


def _check_deepspeed_file(path: Path, problems: list[str], world_size: int):
    return _check_deepspeed(_load_json(path), problems, world_size)


def _check_deepspeed(config: dict, problems: list[str], world_size: int):
    """Fill "auto" the way the Trainer does, then parse with DeepSpeed's own config class."""
    problems += not_mappings(config, DEEPSPEED_SECTIONS)
    if problems:
        return None
    problems += strings_that_should_be_values(config)
    if importlib.util.find_spec("deepspeed") is None:
        problems.append("DeepSpeed is not installed, so its parser cannot check this (pip install 'shardscope[deepspeed]')")
    if problems:
        return None
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig, unset_hf_deepspeed_config

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to="none")
    trainer_view = _WithWorldSize(args, world_size)  # train_batch_size = world x micro x accumulation
    try:
        filled = HfTrainerDeepSpeedConfig(json.loads(json.dumps(config)))
        filled.trainer_config_process(trainer_view)
        model = SimpleNamespace(config=SimpleNamespace(hidden_size=4096))  # fills hidden-size "auto" values
        filled.trainer_config_finalize(trainer_view, model, num_training_steps=100)
    except ValueError as error:
        problems += [line.strip("- ") for line in str(error).splitlines() if line.startswith("- ")] or [str(error)]
        return None
    finally:
        unset_hf_deepspeed_config()
    tracked = _ReadTracker(filled.config)
    try:
        parsed = _deepspeed_config(tracked, world_size)
    except Exception as error:  # pydantic ValidationError, DeepSpeedConfigError, AssertionError, TypeError
        problems += _deepspeed_errors(error, tracked)
        return None
    problems += [f"{key}: not a DeepSpeed config key (DeepSpeed ignores it)" for key in tracked.unread()]
    return parsed


class _WithWorldSize:
    """TrainingArguments as seen from `world_size` ranks (this process is not distributed)."""

    def __init__(self, args, world_size):
        self._args, self.world_size = args, world_size

    def __getattr__(self, name):
        return getattr(self._args, name)


def _deepspeed_config(config: dict, world_size: int):
    """`deepspeed.runtime.config.DeepSpeedConfig` for `world_size` ranks, without a process group or GPU."""
    from deepspeed.runtime.config import DeepSpeedConfig

    class OfflineDeepSpeedConfig(DeepSpeedConfig):
        # DeepSpeedConfig asks torch.distributed for the world size; the rest is its own __init__.
        def __init__(self, param_dict, world_size):
            from deepspeed.runtime.config import _reject_removed_config_keys

            self._param_dict = param_dict
            _reject_removed_config_keys(param_dict)
            self.global_rank, self.world_size = 0, world_size
            self._initialize_params(param_dict)
            self._configure_train_batch_size()
            self._do_sanity_check()

    return OfflineDeepSpeedConfig(config, world_size)


def _deepspeed_errors(error: Exception, config: dict) -> list[str]:
    """DeepSpeed's error, one line per field, each named with its section (`compile.disable`)."""
    if not hasattr(error, "errors"):
        return [f"{type(error).__name__}: {error}"]
    lines = []
    for e in error.errors():  # pydantic: the location is relative to the section's own model
        loc = [str(part) for part in e["loc"]]
        sections = [k for k, v in config.items() if isinstance(v, dict) and loc and loc[0] in v]
        name = ".".join(sections[:1] + loc) if loc and loc[0] not in config else ".".join(loc)
        what = "not a key DeepSpeed knows there; DeepSpeed refuses the file" if e.get("type") == "extra_forbidden" \
            else f"{e['msg']}; DeepSpeed refuses the file"
        lines.append(f"{name}: {what} (got {e.get('input')!r})")
    return lines


# --- accelerate yaml

FSDP_BOOLEANS = {"fsdp_offload_params", "fsdp_forward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states",
                 "fsdp_cpu_ram_efficient_loading", "fsdp_activation_checkpointing",
                 "fsdp_activation_checkpointing_offload"}
DEEPSPEED_BOOLEANS = {"zero3_init_flag", "zero3_save_16bit_model"}


def accelerate_sections() -> list[str]:
    """The accelerate yaml keys that hold a mapping (fsdp_config, deepspeed_config, ...)."""
    from accelerate.commands.config.config_args import ClusterConfig

    return [name for name, f in ClusterConfig.__dataclass_fields__.items() if "dict" in str(f.type)]


@functools.lru_cache(maxsize=1)
def _launcher_keys() -> dict[str, dict]:
    """`accelerate launch` arguments (dest -> argparse action) by the nested yaml section they are copied from."""
    from accelerate.commands.launch import launch_command_parser

    groups = {group.title: group._group_actions for group in launch_command_parser()._action_groups}
    sections = {"fsdp_config": "FSDP Arguments", "deepspeed_config": "DeepSpeed Arguments",
                "parallelism_config": "ParallelismConfig Arguments"}
    return {section: {action.dest: action for action in groups[title]} for section, title in sections.items()}


def _check_accelerate(path: Path, problems: list[str], world_size: int):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    raw = _parsed(path, parse_yaml)
    if not isinstance(raw, dict):
        raise ConfigProblems([f"{path}: the top level must be a mapping of accelerate config keys"])
    known = set(ClusterConfig.__dataclass_fields__) | {"fp16", "dynamo_backend"}  # last two: converted by accelerate
    problems += [f"{key}: not an accelerate config key" for key in sorted(set(raw) - known, key=str)]
    problems += not_mappings(raw, accelerate_sections())
    if problems:
        return None
    try:
        loaded = load_config_from_file(str(path))  # accelerate's own loader: rejects unknown keys, bad enums
    except (ValueError, TypeError) as error:
        problems.append(str(error))
        return None
    launcher = _launcher_keys()
    for section, allowed in launcher.items():
        for key, value in (raw.get(section) or {}).items():
            arg = f"fsdp_{key}" if section == "fsdp_config" and not key.startswith("fsdp_") else key
            if arg not in allowed and arg != "fsdp_ignored_modules":  # ignored_modules: read from the yaml only
                close = difflib.get_close_matches(arg, allowed, n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                problems.append(f"{section}.{key}: not a launcher argument, accelerate would ignore it{hint}")
            else:
                problems += _check_value(section, key, arg, value, raw)
    if not problems:
        _check_launch(path, loaded, problems)
    return loaded


def _check_value(section: str, key: str, arg: str, value, raw: dict) -> list[str]:
    from accelerate.utils.constants import (DEEPSPEED_MULTINODE_LAUNCHERS, FSDP_AUTO_WRAP_POLICY,
                                            FSDP_BACKWARD_PREFETCH, FSDP_SHARDING_STRATEGY, FSDP_STATE_DICT_TYPE)

    fsdp_version = str((raw.get("fsdp_config") or {}).get("fsdp_version", 1))
    choices = {
        "fsdp_version": ["1", "2"], "zero_stage": ["0", "1", "2", "3"],
        "offload_optimizer_device": ["none", "cpu", "nvme"], "offload_param_device": ["none", "cpu", "nvme"],
        "fsdp_auto_wrap_policy": FSDP_AUTO_WRAP_POLICY, "fsdp_sharding_strategy": FSDP_SHARDING_STRATEGY,
        "fsdp_backward_prefetch": FSDP_BACKWARD_PREFETCH, "fsdp_state_dict_type": FSDP_STATE_DICT_TYPE,
        "deepspeed_multinode_launcher": DEEPSPEED_MULTINODE_LAUNCHERS,
        "fsdp_reshard_after_forward": ["true", "false"] if fsdp_version == "2" else FSDP_SHARDING_STRATEGY,
    }
    where = f"{section}.{key}"
    if arg in FSDP_BOOLEANS | DEEPSPEED_BOOLEANS and str(value).lower() not in ("true", "false"):
        return [f"{where}: expected true or false, got {value!r}"]
    if arg in choices and not {str(value), str(value).upper(), str(value).lower()} & set(choices[arg]):
        return [f"{where}: {value!r} is not one of {', '.join(choices[arg])}"]
    if arg == "fsdp_reshard_after_forward" and fsdp_version == "1" and "fsdp_sharding_strategy" not in raw["fsdp_config"]:
        return [f"{where}: accelerate 1.15 ignores it under FSDP1 (the launcher's fsdp_sharding_strategy, default "
                "FULL_SHARD, wins); set fsdp_sharding_strategy instead"]
    kind = _launcher_keys()[section][arg].type
    if kind in (int, float) and not isinstance(value, (int, float)):
        return [f"{where}: expected a number, got {value!r}"]
    return []


def launch_args(config_file, *flags: str, script: str = "train.py"):
    """The argument namespace `accelerate launch --config_file FILE FLAGS... SCRIPT` would run with."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    parser = launch_command_parser()
    args = parser.parse_args(["--config_file", str(config_file), *flags, script])
    args, defaults, mp_from_config_flag = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command: the DeepSpeed fields the yaml set
        fields = [*(defaults.deepspeed_config if defaults else ()), *(["mixed_precision"] if mp_from_config_flag else [])]
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    return args


def launch_env(args) -> dict:
    """The environment accelerate's launcher would export for `args` (FSDP/DDP and DeepSpeed paths)."""
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    if args.use_deepspeed:
        return prepare_deepspeed_cmd_env(args)[1]
    return prepare_multi_gpu_env(args)


def _check_launch(path: Path, loaded, problems: list[str]):
    """Build the launcher's arguments and environment, then the plugin a launched process would build."""
    from accelerate.utils import DeepSpeedPlugin, patch_environment

    try:
        # port 0: pick a free port, so validation never depends on (or probes) the configured one
        args = launch_args(path, "--main_process_port", "0")
        if not (args.use_fsdp or args.use_deepspeed or args.use_parallelism_config):
            return
        env = launch_env(args)
        with patch_environment(**{k: v for k, v in env.items() if os.environ.get(k) != v}):
            if args.use_parallelism_config:  # HSDP / TP meshes: accelerate's own checks, then every process covered
                from accelerate.parallelism_config import ParallelismConfig

                mesh = ParallelismConfig()
                problems += _sequence_split_problems(mesh, args)
                if mesh.sp_enabled:  # DeepSpeed builds its own groups: sp x tp divides the processes, the rest is dp
                    if args.num_processes % (mesh.sp_size * mesh.tp_size):
                        problems.append(f"parallelism_config.parallelism_config_sp_size: {mesh.sp_size} x tp_size "
                                        f"{mesh.tp_size} does not divide num_processes {args.num_processes}")
                elif mesh.total_size != args.num_processes:
                    problems.append(f"parallelism_config: dp_replicate_size x dp_shard_size x tp_size x ... = "
                                    f"{mesh.total_size}, but num_processes is {args.num_processes}")
            if args.use_fsdp:
                _fsdp_plugin()
            elif args.use_deepspeed:
                plugin = DeepSpeedPlugin()
                _check_deepspeed(plugin.deepspeed_config, problems, world_size=loaded.num_processes)
    except (ValueError, TypeError, KeyError, AssertionError, RuntimeError) as error:
        problems += _refused_beside_deepspeed_file(args, error) or [f"accelerate rejects it at launch: {error}"]


def _refused_beside_deepspeed_file(args, error) -> list[str]:
    """The yaml keys accelerate's DeepSpeed plugin refuses beside `deepspeed_config_file` (it lists what it ignores;
    the launcher passed which of them the yaml set), one problem per key."""
    listed = re.search(r"deepspeed_config_file`, the following accelerate config variables will be ignored: (\[.*?\])",
                       str(error))
    if not listed:
        return []
    ignored = set(ast.literal_eval(listed.group(1)))
    fields = [f for f in getattr(args, "deepspeed_fields_from_accelerate_config", "").split(",") if f in ignored]
    return [f"{'' if field == 'mixed_precision' else 'deepspeed_config.'}{field}: accelerate rejects it at launch "
            "beside deepspeed_config_file, even where the DeepSpeed file agrees (set it there only)" for field in fields]


def _sequence_split_problems(mesh, args) -> list[str]:
    """A context-parallel split needs FSDP2 and a sequence-parallel one DeepSpeed ZeRO (accelerate 1.15)."""
    if mesh.cp_enabled and not (args.use_fsdp and str(args.fsdp_version) == "2"):
        return [f"parallelism_config.parallelism_config_cp_size: {mesh.cp_size} needs distributed_type FSDP with "
                "fsdp_version 2 (torch context parallelism runs over FSDP2); for DeepSpeed use "
                "parallelism_config_sp_size"]
    if mesh.sp_enabled and not args.use_deepspeed:
        return [f"parallelism_config.parallelism_config_sp_size: {mesh.sp_size} needs distributed_type DEEPSPEED "
                "(Ulysses sequence parallelism runs inside DeepSpeed ZeRO); for FSDP2 use parallelism_config_cp_size"]
    return []


def _fsdp_plugin(**kwargs):
    """accelerate's FSDP plugin from `kwargs` and the FSDP_* environment, as a launched process builds it.

    FSDP1's rank-0 broadcast looks up an accelerator device, a property of the run rather than of the
    file, so on a machine without one that lookup is skipped."""
    from accelerate.utils import FullyShardedDataParallelPlugin, is_cuda_available, is_xpu_available

    version = int(kwargs.get("fsdp_version") or os.environ.get("FSDP_VERSION", 1))
    if version == 1 and not (is_cuda_available() or is_xpu_available()):
        kwargs.update(sync_module_states=False, cpu_ram_efficient_loading=False)
    return FullyShardedDataParallelPlugin(**kwargs)


# --- Trainer fsdp_config JSON


def _check_fsdp(path: Path, problems: list[str], world_size: int):
    """`TrainingArguments(fsdp=True, fsdp_config=...)`, then the FSDP plugin the Trainer builds from it."""
    config = _load_json(path)
    problems += strings_that_should_be_values(config)
    if problems:
        return None
    from transformers import TrainingArguments

    tracked = _ReadTracker(config)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to="none", fsdp=True, fsdp_config=tracked)
        plugin = _fsdp_plugin(**args.fsdp_plugin_args)  # what Trainer.create_accelerator_and_postprocess builds
    except (ValueError, TypeError, KeyError) as error:
        problems.append(f"TrainingArguments rejects it: {error}")
        return None
    problems += _fsdp1_strategy_ignored(config, plugin)
    # keys transformers did not read for this config (unknown, or meant for the other FSDP version)
    version = config.get("version", config.get("fsdp_version", 2))
    problems += [f"{key}: not read by TrainingArguments for an FSDP{version} fsdp_config (ignored)"
                 for key in tracked.unread()]
    return args


def _fsdp1_strategy_ignored(config: dict, plugin) -> list[str]:
    """FSDP1 wraps with `sharding_strategy or reshard_after_forward` (accelerate's Accelerator.prepare_model), and
    the plugin fills `sharding_strategy` from FSDP_SHARDING_STRATEGY or FULL_SHARD when the Trainer passes none (it
    never does): a `reshard_after_forward` strategy other than that is silently not the one trained."""
    asked = config.get("reshard_after_forward")
    if plugin.fsdp_version != 1 or asked is None or plugin.sharding_strategy is None:
        return []
    if str(asked).upper() == plugin.sharding_strategy.name:
        return []
    return [f"reshard_after_forward: {asked!r} is not what FSDP1 trains: accelerate wraps with its sharding_strategy, "
            f"{plugin.sharding_strategy.name} (FSDP_SHARDING_STRATEGY or its default; the Trainer's fsdp_config cannot "
            "set it); use FSDP2 (an accelerate yaml with a parallelism_config for HYBRID_SHARD)"]


# --- SLURM script


def _check_slurm(path: Path, problems: list[str], world_size: int):
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    problems += [line for line in result.stderr.splitlines() if line.strip()]
    return path.read_text()
