"""`fit --output-dir`'s ready-to-launch files: the winner's shipped accelerate config with this run's processes,
machines and mesh, the recipe `--config` YAML of its Trainer arguments, and the result as JSON (each atomically)."""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import UsageError
from ..model.spec import resolve_model
from ..plan.mesh import Setup
from ..plan.sequence import SPLIT_CONFIGS, parse_row_name
from ..strategy import TP_STRATEGIES, family, strategy_record
from ..units import gb

ACCELERATE_FILE, TRAINING_FILE, RESULT_FILE = "accelerate_config.yaml", "training_args.yaml", "fit.json"
MIXED = {"fp32": "no", "bf16-mixed": "bf16", "fp16-mixed": "fp16", "bf16-pure": "bf16"}


def model_source(args, spec) -> str | None:
    """What `model_name_or_path` the recipe should load: a shipped name's hub id, else the folder or id given."""
    if not args.model:
        return None
    resolved = resolve_model(args.model)
    if resolved != args.model:  # a shipped name: its config records the hub id
        from ..safe_io import load_json

        return load_json(Path(resolved) / "config.json", "shipped config").get("_name_or_path") or args.model
    return args.model


def accelerate_config(result: dict) -> tuple[dict, str]:
    """The shipped accelerate yaml of the winning strategy, with this run's process count, machines and mesh."""
    import yaml

    from ..configs.catalog import find_config

    strategy, setup, mesh = result["strategy"], result["setup"], result["mesh"]
    split = parse_row_name(strategy)  # "zero3/sp4": the shipped split config, its degree below
    if split:
        name = SPLIT_CONFIGS[split[1]]
    else:  # the record's shipped yaml, its multi-node one on several nodes where it has one
        record = strategy_record(strategy)
        name = (setup["nodes"] > 1 and record.multinode_config) or record.config
    shipped = find_config(name)
    config = yaml.safe_load(shipped.path.read_text())
    config["num_processes"] = setup["world_size"]
    if setup["nodes"] > 1:
        config.update(num_machines=setup["nodes"], machine_rank=config.get("machine_rank", 0),
                      main_process_ip=config.get("main_process_ip", "127.0.0.1"),
                      main_process_port=config.get("main_process_port", 29500), rdzv_backend="static")
        if config.get("distributed_type") == "DEEPSPEED":
            config["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
    else:
        for key in ("num_machines", "machine_rank", "main_process_ip", "main_process_port", "rdzv_backend"):
            config.pop(key, None)
    if split:
        kind, degree = split[1:]
        config["parallelism_config"][f"parallelism_config_{kind}_size"] = degree
        if kind == "cp":  # FSDP2 shards over dp_shard x cp
            config["parallelism_config"]["parallelism_config_dp_shard_size"] = setup["world_size"] // degree
    elif "parallelism_config" in config or strategy in TP_STRATEGIES:
        config["parallelism_config"] = {f"parallelism_config_{k}_size": mesh[k] for k in ("dp_replicate", "dp_shard",
                                                                                         "tp")}
    if config.get("distributed_type") != "DEEPSPEED":  # DeepSpeed takes its precision from the Trainer
        config["mixed_precision"] = MIXED[setup["precision"]]
    return config, str(shipped.path.name)


def training_config(result: dict, args, spec) -> dict:
    """The Trainer arguments as a recipe `--config` YAML (recipes/causal_lm_sft.py keys)."""
    setup = result["setup"]
    out = {}
    source = model_source(args, spec)
    if source:
        out["model_name_or_path"] = source
    if spec.kind == "text":
        out["max_seq_length"] = setup["seq_len"]
        if getattr(args, "dataset", None):  # fit --dataset: the data it decided on
            out["dataset"] = args.dataset
    out.update(per_device_train_batch_size=result["per_device_train_batch_size"],
               gradient_accumulation_steps=result["gradient_accumulation_steps"],
               gradient_checkpointing=result["gradient_checkpointing"])
    if setup["precision"] != "fp32":
        out["fp16" if setup["precision"] == "fp16-mixed" else "bf16"] = True
    if setup["precision"] == "bf16-pure" and family(result["strategy"]) != "deepspeed":
        out["dtype"] = "bfloat16"
    if setup["lora_rank"]:
        targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
        out.update(use_lora=True, lora_r=setup["lora_rank"], lora_target_modules=targets)
    out["output_dir"] = f"runs/fit-{result['strategy'].replace('/', '-')}"
    return out


def write_files(result: dict, args, spec, setup: Setup) -> dict:
    """accelerate config + recipe YAML + the JSON result, each written atomically into --output-dir."""
    import yaml

    from ..safe_io import atomic_write_text

    folder = Path(args.output_dir)
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--output-dir {folder}: not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--output-dir {folder}: cannot be created ({error.strerror or error})") from None
    config, source = accelerate_config(result)
    summary = (f"# shardscope fit: {result['strategy']}, micro-batch {result['per_device_train_batch_size']} x "
               f"accumulation {result['gradient_accumulation_steps']} x data-parallel {result['data_parallel_size']} "
               f"= global batch {result['global_batch']}, checkpointing "
               f"{'on' if result['gradient_checkpointing'] else 'off'}; planned peak {gb(result['peak_bytes'])} GB "
               f"of {gb(result['usable_bytes'])} GB usable per GPU\n")
    header = summary + f"# from accelerate_configs/{source}" + (
        "; on every node pass --machine_rank, --main_process_ip and --main_process_port" if setup.nodes > 1 else "")
    files = {"accelerate_config": str(folder / ACCELERATE_FILE), "training_args": str(folder / TRAINING_FILE),
             "result": str(folder / RESULT_FILE)}
    atomic_write_text(files["accelerate_config"], header + "\n" + yaml.safe_dump(config, sort_keys=False), "--output-dir")
    training = training_config(result, args, spec)
    note = "" if "model_name_or_path" in training else "# add model_name_or_path (a folder or hub id): --params has none\n"
    atomic_write_text(files["training_args"], summary + note + yaml.safe_dump(training, sort_keys=False), "--output-dir")
    files["launch"] = (f"accelerate launch --config_file {files['accelerate_config']} "
                       f"{'recipes/causal_lm_sft.py' if spec.kind == 'text' else 'recipes/image_classification.py'} "
                       f"--config {files['training_args']}")
    atomic_write_text(files["result"], json.dumps({**result, "files": files}, indent=1), "--output-dir")
    return files
