"""An accelerate yaml checked by accelerate's own loader, then key by key against the launcher's arguments (keys it
would ignore, values it would refuse), then as launched: the launcher's arguments and environment, accelerate's
mesh, and the FSDP or DeepSpeed plugin a launched process would build from them."""
from __future__ import annotations

import difflib
import os
from pathlib import Path

from ..safe_io import parse_yaml
from .deepspeed import validate_deepspeed
from .files import ConfigProblems, not_mappings, parsed
from .fsdp import fsdp1_sharding_problem, fsdp_plugin
from .launcher import launch_args, launch_env, launcher_keys, refused_beside_deepspeed_file

FSDP_BOOLEANS = {"fsdp_offload_params", "fsdp_forward_prefetch", "fsdp_use_orig_params", "fsdp_sync_module_states",
                 "fsdp_cpu_ram_efficient_loading", "fsdp_activation_checkpointing",
                 "fsdp_activation_checkpointing_offload"}
DEEPSPEED_BOOLEANS = {"zero3_init_flag", "zero3_save_16bit_model"}


def accelerate_sections() -> list[str]:
    """The accelerate yaml keys that hold a mapping (fsdp_config, deepspeed_config, ...)."""
    from accelerate.commands.config.config_args import ClusterConfig

    return [name for name, f in ClusterConfig.__dataclass_fields__.items() if "dict" in str(f.type)]


def validate_accelerate(path: Path, problems: list[str], world_size: int):
    """accelerate's `ClusterConfig` of the yaml (its own `num_processes`, not `world_size`), `problems` appended."""
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    raw = parsed(path, parse_yaml)
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
    for section, allowed in launcher_keys().items():
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
    kind = launcher_keys()[section][arg].type
    if kind in (int, float) and not isinstance(value, (int, float)):
        return [f"{where}: expected a number, got {value!r}"]
    return []


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
                problems += _mesh_problems(args)
            if args.use_fsdp:
                asked = (loaded.fsdp_config or {}).get("fsdp_reshard_after_forward")
                problems += fsdp1_sharding_problem(
                    "fsdp_config.fsdp_reshard_after_forward", asked, fsdp_plugin(),
                    "the launcher's fsdp_sharding_strategy, default FULL_SHARD",
                    "FSDP1 reads fsdp_sharding_strategy: set that instead")
            elif args.use_deepspeed:
                plugin = DeepSpeedPlugin()
                validate_deepspeed(plugin.deepspeed_config, problems, world_size=loaded.num_processes)
    except (ValueError, TypeError, KeyError, AssertionError, RuntimeError) as error:
        problems += refused_beside_deepspeed_file(args, error) or [f"accelerate rejects it at launch: {error}"]


def _mesh_problems(args) -> list[str]:
    """accelerate's `ParallelismConfig` from the launched environment: a split's strategy, every process covered."""
    from accelerate.parallelism_config import ParallelismConfig

    mesh = ParallelismConfig()
    problems = _sequence_split_problems(mesh, args)
    if mesh.sp_enabled:  # DeepSpeed builds its own groups: sp x tp divides the processes, the rest is dp
        if args.num_processes % (mesh.sp_size * mesh.tp_size):
            problems.append(f"parallelism_config.parallelism_config_sp_size: {mesh.sp_size} x tp_size "
                            f"{mesh.tp_size} does not divide num_processes {args.num_processes}")
    elif mesh.total_size != args.num_processes:
        problems.append(f"parallelism_config: dp_replicate_size x dp_shard_size x tp_size x ... = "
                        f"{mesh.total_size}, but num_processes is {args.num_processes}")
    return problems


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
