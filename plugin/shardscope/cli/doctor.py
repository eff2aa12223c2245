"""`shardscope doctor` arguments and printing; the rules are doctor/'s (`diagnose`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..configs.catalog import resolve_config
from ..doctor.diagnose import Inputs, diagnose, parse_trainer_args
from ..doctor.rules import failing
from ..errors import UsageError


def register(subparsers) -> None:
    p = subparsers.add_parser("doctor", help="find config mistakes before launch",
                              description="Check accelerate/DeepSpeed/FSDP configs against each other, the model, "
                                          "the GPUs and the Trainer/recipe arguments given after --. Exit 0: no "
                                          "errors or warnings (notices may be printed); 1: errors or warnings; "
                                          "2: unusable input.")
    shipped = "a path or a shipped name"
    p.add_argument("--accelerate-config", help=f"accelerate launch --config_file yaml: {shipped} (zero3)")
    p.add_argument("--deepspeed", help=f"DeepSpeed JSON (TrainingArguments(deepspeed=...)): {shipped} (ds/zero3)")
    p.add_argument("--fsdp-config", help=f"fsdp_config JSON (TrainingArguments(fsdp_config=...)): {shipped} "
                                         "(fsdp/llama_full_shard)")
    p.add_argument("--hostfile", help="DeepSpeed hostfile (deepspeed --hostfile): hosts, slots, ssh (example: "
                                      "ds_configs/hostfile)")
    p.add_argument("--model", help="shipped name (shardscope plan --list-models), local folder or hub id (default: "
                                   "the recipe's model_name_or_path)")
    p.add_argument("--gpus", type=int, help="GPUs per node, for the fit check")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu", help="GPU name (see shardscope plan --help)")
    p.add_argument("--gpu-memory", help="memory per GPU: 80GB, 80GiB")
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- recipe.py ARGS, or -- Trainer ARGS")
    p.set_defaults(func=doctor_command)


def doctor_command(args) -> int:
    from ..units import gpu_memory, parse_size

    rest = args.args[1:] if args.args[:1] == ["--"] else args.args
    for flag, value in (("--gpus", args.gpus), ("--nodes", args.nodes)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be at least 1, got {value}")
    inputs = Inputs(accelerate_config=resolve_config(args.accelerate_config, "accelerate"),
                    deepspeed=resolve_config(args.deepspeed, "deepspeed"),
                    fsdp_config=resolve_config(args.fsdp_config, "fsdp"), model=args.model, gpus=args.gpus,
                    nodes=args.nodes, hostfile=Path(args.hostfile) if args.hostfile else None)
    if args.gpu_memory or args.gpu:
        inputs.gpu_memory_bytes = parse_size(args.gpu_memory) if args.gpu_memory else gpu_memory(args.gpu)
    if rest:
        inputs.trainer, inputs.trainer_source = parse_trainer_args(rest)
        if inputs.model is None and inputs.trainer.get("model_name_or_path"):
            inputs.model, inputs.model_from_args = inputs.trainer["model_name_or_path"], True
    ran: list[str] = []
    findings, notes = diagnose(inputs, ran=ran)
    for note in notes:
        print(f"note: {note}")
    for finding in findings:
        print(f"{finding.level} [{finding.code}] {finding}")
    bad = failing(findings)
    counts = ", ".join(f"{sum(f.level == level for f in findings)} {level}(s)" for level in ("error", "warning", "notice")
                       if any(f.level == level for f in findings))
    checked = "; ".join(ran) or "the accelerate default config only"
    print(f"{counts} found (checked: {checked})" if findings else f"no problems found (checked: {checked})")
    return 1 if bad else 0
