"""The launcher's view of an accelerate yaml, through accelerate's own code: the arguments `accelerate launch`
runs with (`launch_args`), the environment it exports (`launch_env`), its arguments by the yaml section they are
copied from (`launcher_keys`), and the yaml's DeepSpeed fields it refuses beside a DeepSpeed file."""
from __future__ import annotations

import ast
import functools
import re


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


@functools.lru_cache(maxsize=1)
def launcher_keys() -> dict[str, dict]:
    """`accelerate launch` arguments (dest -> argparse action) by the nested yaml section they are copied from."""
    from accelerate.commands.launch import launch_command_parser

    groups = {group.title: group._group_actions for group in launch_command_parser()._action_groups}
    sections = {"fsdp_config": "FSDP Arguments", "deepspeed_config": "DeepSpeed Arguments",
                "parallelism_config": "ParallelismConfig Arguments"}
    return {section: {action.dest: action for action in groups[title]} for section, title in sections.items()}


def refused_beside_deepspeed_file(args, error) -> list[str]:
    """The yaml keys accelerate's DeepSpeed plugin refuses beside `deepspeed_config_file`, one problem per key.

    The plugin's list of what it ignores is a local of its `_deepspeed_config_checks`, reachable only in the error it
    raises, so it is read from that text; the launcher passed which of them the yaml set."""
    listed = re.search(r"deepspeed_config_file`, the following accelerate config variables will be ignored: (\[.*?\])",
                       str(error))
    if not listed:
        return []
    ignored = set(ast.literal_eval(listed.group(1)))
    fields = [f for f in getattr(args, "deepspeed_fields_from_accelerate_config", "").split(",") if f in ignored]
    return [f"{'' if field == 'mixed_precision' else 'deepspeed_config.'}{field}: accelerate rejects it at launch "
            "beside deepspeed_config_file, even where the DeepSpeed file agrees (set it there only)" for field in fields]
