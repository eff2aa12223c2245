"""`shardscope doctor`: the config mistakes that cost a GPU-hour, found before launch.

    shardscope doctor [--accelerate-config F] [--deepspeed F] [--fsdp-config F] [--model M]
                      [--gpus N --gpu NAME | --gpu-memory SIZE] [-- recipe.py --config r.yaml ... | -- TRAINER ARGS]

Every finding names the file, the key, its level and the fix. Exit 0: clean or notices only; 1: errors or
warnings; 2: unusable input. Each file is first validated by `configs/validate.py`'s `validate_config` (the
libraries' own loaders); the rules live by library in doctor/deepspeed.py, doctor/fsdp.py and doctor/launch.py,
their codes and levels in `doctor_rules.RULES`, and docs/doctor.md says where each comes from. `shardscope configs
check` runs `check_files` here: one set of rules, one verdict.

Trainer arguments are only parsed (HfArgumentParser over `TrainingArguments`, or over a recipe's own
dataclasses), never constructed: constructing `TrainingArguments` starts the process group.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from ..configs.catalog import resolve_config
from ..configs.validate import validate_config
from ..configs.files import ConfigProblems
from .cluster import cluster_checks
from .deepspeed import (asked_for_offload, check_accelerate_deepspeed, check_deepspeed,
                               check_deepspeed_precision, planner_settings)
from .fsdp import check_fsdp_keys, check_fsdp_offload, check_wrap_class, wrap_classes
from .launch import check_default_config, check_multinode, check_precision, check_processes
from .qlora import check_quantized, quantized_bits
from ..plan.planner import tp_experts_note
from .precision import precision_findings
from .sequence import check_sequence_split, split_of, with_split_rows
from .rules import Finding, failing, read_checked, read_raw
from ..units import as_int
from ..errors import UsageError
from ..model.spec import attention_heads
from ..plan.mesh import tp_heads_problem, valid_tp_degrees
from ..plan.sequence import row_name
from ..recipes.source import recipe_dataclasses
from ..strategy import configured_precision, fsdp_settings, strategy_of_config, strategy_record, tp_mesh_of_config

__all__ = ["Finding", "Inputs", "check_files", "diagnose", "parse_trainer_args", "startup_checks"]


# ----------------------------------------------------------------------------- inputs


@dataclass
class Inputs:
    accelerate_config: Path | None = None
    deepspeed: Path | None = None
    fsdp_config: Path | None = None
    hostfile: Path | None = None    # DeepSpeed launcher's hostfile
    model: str | None = None
    model_from_args: bool = False   # taken from the recipe's model_name_or_path: an unloadable one is skipped
    trainer: dict | None = None     # parsed (not constructed) Trainer/recipe arguments
    trainer_source: str = "trainer arguments"
    gpus: int | None = None
    nodes: int = 1
    gpu_memory_bytes: int | None = None


def parse_trainer_args(argv: list[str]) -> tuple[dict, str]:
    """Parse `recipe.py ARGS` with the recipe's own dataclasses (read from its source, not run), or bare Trainer
    ARGS with TrainingArguments. Returns (values by field name, where they came from); nothing is constructed."""
    from transformers import TrainingArguments

    from ..recipes.args import RecipeParser

    source = "trainer arguments"
    types, training_type = [], TrainingArguments
    if argv and argv[0].endswith(".py"):  # read, never run: a recipe's top-level code stays unexecuted
        types, training_type = recipe_dataclasses(Path(argv[0]))
        source, argv = argv[0], argv[1:]
    parser = RecipeParser(*types, training_type=training_type)
    parser.parse(argv)
    config = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"), None)
    return dict(parser.namespace), config or source


# ----------------------------------------------------------------------------- checks


def _validated(path: Path, kind: str, findings: list[Finding], world_size: int) -> None:
    """The library loaders' problems as findings: "ignored-key" where the library loads the file and
    ignores the key, "config" where it refuses the file."""
    try:
        validate_config(path, kind, world_size=world_size)
    except ConfigProblems as error:
        for line in error.problems:
            rest = line.removeprefix(f"{path}: ")
            if rest.startswith("ds ") and " vs hf " in rest:
                continue  # compared with default TrainingArguments; check_deepspeed compares with the real ones
            key, _, problem = rest.partition(": ")
            if rest.startswith(f"{path}:"):  # FILE:LINE:COL: malformed ...
                where, _, problem = rest.removeprefix(f"{path}:").partition(": ")
                key = f"line {where}"
            elif " " in key or not problem:
                key, problem = "-", rest
            if "ignore" in problem:
                findings.append(Finding("ignored-key", str(path), key, problem,
                                        "remove it, or use the key this version reads"))
            else:
                findings.append(Finding("config", str(path), key, problem, "the library refuses the file: "
                                        "correct this value"))


# --- strategy and planner


def check_tp_experts(file: str, spec) -> list[Finding]:
    """A mixture of experts whose TP plan splits none of its experts (gpt-oss): TP divides only the rest."""
    if not spec.tp_whole_expert_params:
        return []
    return [Finding("tp-experts", file, "parallelism_config.parallelism_config_tp_size", tp_experts_note(spec),
                    "shard the experts with fsdp_full_shard or zero3 (or expert parallelism: transformers' "
                    "DistributedConfig(ep_size=N), docs/planner.md)")]


def check_tp_degree(file: str, tp: int, config, trainer: dict | None) -> list[Finding]:
    """Tensor parallelism splits attention by heads along the model's TP plan: both must allow `tp`."""
    key = "parallelism_config.parallelism_config_tp_size"
    heads, kv = attention_heads(config)
    findings = []
    if not getattr(config, "base_model_tp_plan", None):
        findings.append(Finding("tp-degree", file, key, f"model type '{config.model_type}' has no tensor-parallel "
                                "plan in transformers (config.base_model_tp_plan)", "use fsdp_full_shard or zero3"))
    elif heads is None or tp_heads_problem(tp, heads, kv):
        fits = valid_tp_degrees(heads or 1, kv or 1)
        findings.append(Finding("tp-degree", file, key, f"{tp} does not divide the model's attention heads "
                                f"(num_attention_heads {heads}, num_key_value_heads {kv})",
                                f"use a tp_size in {', '.join(map(str, fits))}"))
    if trainer and str(trainer.get("use_lora", "")).lower() == "true":
        findings.append(Finding("tp-degree", file, key, "LoRA under tensor parallelism is refused by the recipe",
                                "train LoRA with ddp, fsdp_full_shard or zero2/zero3"))
    return findings


def check_fit(file: str, strategy: str, spec, inputs: Inputs, mesh: dict | None = None,
              zero: dict | None = None, split: tuple | None = None) -> list[Finding]:
    """`mesh`: a TP yaml's degrees (then the planner's setup instead of --gpus/--nodes); `zero`: a DeepSpeed file's
    zero_optimization (offload, sub-group size); `split`: the yaml's (cp/sp, degree), planned as `plan --sp/--cp`.
    The peak is `plan --model`'s, traced (`trace_cache`; the formula where tracing fails: said approximate). The fix
    is the cheapest change that makes this strategy fit (--bf16, then --gradient_checkpointing), else the planner's."""
    from ..plan.mesh import LibraryKnobs, Setup, setup_for_mesh
    from ..plan.planner import estimate, usable_bytes
    from ..plan.trace_cache import cached_traces_for
    from ..units import gb, gpu_size

    def plan(setup):
        traces, note = cached_traces_for(inputs.model, setup)
        knobs = LibraryKnobs(**planner_settings(zero or {}))
        return with_split_rows(estimate(spec, setup, traces, knobs), spec, setup, split, inputs.model, knobs), note

    trainer = inputs.trainer or {}
    precision = configured_precision(trainer.get("bf16"), trainer.get("fp16")) if inputs.trainer is not None \
        else "bf16-mixed"  # no Trainer arguments given: bf16, the recipes' default
    lora = int(trainer.get("lora_r") or 0) if trainer.get("use_lora") or trainer.get("lora_r") and "use_lora" not in trainer else 0
    setup = Setup(gpus_per_node=inputs.gpus, nodes=inputs.nodes, gpu_memory_bytes=inputs.gpu_memory_bytes,
                  precision=precision, micro_batch=int(trainer.get("per_device_train_batch_size") or 1),
                  seq_len=int(trainer.get("max_seq_length") or 2048),
                  activation_checkpointing=bool(trainer.get("gradient_checkpointing")),
                  lora_rank=lora, lora_targets=("all-linear",) if lora else ("q_proj", "v_proj"),
                  grad_accum_steps=int(trainer.get("gradient_accumulation_steps") or 1))
    if mesh:
        strategy, setup = setup_for_mesh(setup, mesh)
    strategy = row_name(strategy, *split) if split else strategy
    result, note = plan(setup)
    rows = {r.strategy: r for r in result["rows"]}
    if strategy not in rows:  # a TP yaml with a model that has no TP plan: the tp-degree finding says so
        return []
    row, best = rows[strategy], result["recommendation"]
    if row.fits:
        return []
    fix = f"use {best['strategy']} ({best['reason']})" if best["strategy"] else best["reason"]
    flags = []
    for flag, change in (("--bf16", {"precision": "bf16-mixed"}), ("--gradient_checkpointing",
                                                                   {"activation_checkpointing": True})):
        key, value = next(iter(change.items()))
        if getattr(setup, key) == value or (flag == "--bf16" and precision != "fp32"):
            continue
        setup = dataclasses.replace(setup, **change)
        flags.append(flag)
        cheaper = {r.strategy: r for r in plan(setup)[0]["rows"]}[strategy]
        if cheaper.fits:
            fix = f"pass {' '.join(flags)}: {strategy} then needs {gb(cheaper.peak_bytes)} GB per GPU " \
                  f"(cheaper than changing strategy); else {fix}"
            break
    what = (f"{strategy} needs {gb(row.peak_bytes)} GB per GPU at its peak ({row.peak_phase}); a "
            f"{gpu_size(inputs.gpu_memory_bytes)} GPU has {gb(usable_bytes(setup))} GB usable "
            f"({setup.headroom:.0%} headroom kept)")
    if strategy == "ddp":
        what += f" (DDP/NO_SHARD keeps all {gb(row.model_states_bytes)} GB of model states on every GPU)"
    if row.activations_source != "traced":
        note = note or f"activations from a written-out formula (approximate) for {strategy}"
    return [Finding("no-fit", file, "strategy", f"{what} ({spec.name}, {setup.world_size} GPUs, {precision}, "
                    f"micro-batch {setup.micro_batch}, seq {setup.seq_len}" + (f"; {note}" if note else "") + ")",
                    fix)]


# ----------------------------------------------------------------------------- the doctor


def _trainer_file(value: str, kind: str) -> Path:
    """A file the Trainer arguments name: the Trainer reads a path, so a shipped name there is one line naming
    the path to give instead (anything else missing is for the reader to say)."""
    if not os.path.lexists(value):
        try:
            shipped = resolve_config(value, kind)
        except UsageError:
            return Path(value)
        flag = "--deepspeed" if kind == "deepspeed" else "--fsdp_config"
        raise UsageError(f"{flag} {value}: no such file; the Trainer reads a path: {flag} {shipped} (the shipped "
                         f"'{value}', `shardscope configs path` prints it)")
    return Path(value)


def diagnose(inputs: Inputs, validate: bool = True, ran: list | None = None, environment: bool = True) -> tuple[list[Finding], list[str]]:
    """All findings for `inputs`, and notes (checks skipped and why); `ran` collects the checks made.
    `validate=False` skips the library loaders (they construct TrainingArguments, which inside a
    launched process starts the process group); `environment=False` skips this machine's accelerate
    default config."""
    findings, notes, ran = [], [], ran if ran is not None else []
    files = _files(inputs, ran)
    _config_findings(inputs, files, validate, environment, findings, notes, ran)
    _model_findings(inputs, files, findings, notes, ran)
    return _dedupe(findings), notes


@dataclass
class _Files:
    """The config files a diagnosis reads: the accelerate yaml's contents and TP mesh, the DeepSpeed and
    fsdp_config files (given, or named in the Trainer arguments or the yaml), the world size."""
    acc: dict | None
    acc_mesh: dict | None
    deepspeed: Path | None
    fsdp: Path | None
    world: int | None


def _files(inputs: Inputs, ran: list) -> _Files:
    trainer, source = inputs.trainer, inputs.trainer_source
    deepspeed, fsdp = inputs.deepspeed, inputs.fsdp_config
    if trainer is not None:  # files named in the Trainer arguments
        if deepspeed is None and isinstance(trainer.get("deepspeed"), str) and trainer["deepspeed"]:
            deepspeed = _trainer_file(trainer["deepspeed"], "deepspeed")
        if fsdp is None and isinstance(trainer.get("fsdp_config"), str) and trainer["fsdp_config"]:
            fsdp = _trainer_file(trainer["fsdp_config"], "fsdp")
    for path, kind in ((inputs.accelerate_config, "accelerate"), (deepspeed, "deepspeed"), (fsdp, "fsdp")):
        if path is not None:
            read_checked(path, kind)  # unreadable or wrongly shaped: exit 2, not a finding
    acc = read_raw(inputs.accelerate_config) if inputs.accelerate_config else None
    acc_mesh = tp_mesh_of_config(acc) if acc is not None else None
    world = None
    if inputs.gpus:
        world = inputs.gpus * inputs.nodes
    elif acc and acc.get("num_processes"):
        world = as_int(acc["num_processes"])
    if acc and deepspeed is None and (acc.get("deepspeed_config") or {}).get("deepspeed_config_file"):
        deepspeed = Path(acc["deepspeed_config"]["deepspeed_config_file"])
        read_checked(deepspeed, "deepspeed")
    ran += [f"{kind} file" for kind, path in (("accelerate", inputs.accelerate_config), ("DeepSpeed", deepspeed),
                                               ("fsdp_config", fsdp)) if path is not None]
    if trainer is not None:
        ran.append(f"Trainer arguments ({source})")
    return _Files(acc, acc_mesh, deepspeed, fsdp, world)


def _config_findings(inputs: Inputs, files: _Files, validate: bool, environment: bool, findings: list,
                     notes: list, ran: list) -> None:
    trainer, source = inputs.trainer, inputs.trainer_source
    acc, deepspeed, fsdp, world = files.acc, files.deepspeed, files.fsdp, files.world
    if trainer is not None:
        findings += check_resume(trainer, world, source)
    if inputs.accelerate_config is None and environment:
        findings += check_default_config()
    if acc is not None:
        file = str(inputs.accelerate_config)
        if validate:
            _validated(inputs.accelerate_config, "accelerate", findings, world or 8)
        findings += check_processes(file, acc, inputs.gpus, inputs.nodes) + check_multinode(file, acc)
        if acc.get("distributed_type") == "FSDP":
            findings += check_fsdp_keys(inputs.accelerate_config, "accelerate")
            findings += check_fsdp_offload(file, acc.get("fsdp_config") or {}, "fsdp_config.")
        if acc.get("distributed_type") == "DEEPSPEED":
            findings += check_accelerate_deepspeed(file, acc, trainer, world, source)
            findings += check_deepspeed_precision(file, acc, read_raw(deepspeed) if deepspeed else {}, trainer)
        if trainer is not None:
            findings += check_precision(file, acc, trainer, source)
        findings += check_sequence_split(file, acc, trainer, source, None, world)  # the model's part: below
    if deepspeed is not None:
        if validate:
            _validated(deepspeed, "deepspeed", findings, world or 8)
        findings += check_deepspeed(deepspeed, trainer, world, source, asked_for_offload(inputs.accelerate_config))
    found, said, checked = cluster_checks(inputs.accelerate_config, acc, inputs.hostfile,
                                          [p for p in (deepspeed, fsdp) if p is not None], inputs.gpus, inputs.nodes,
                                          environment)
    findings += found
    notes += said
    ran += checked
    found, said = precision_findings(inputs.accelerate_config, acc, deepspeed is not None, trainer, source)
    findings += found
    notes += said
    if fsdp is not None:
        if validate:
            _validated(fsdp, "fsdp", findings, world or 8)
        findings += check_fsdp_keys(fsdp, "fsdp")
        findings += check_fsdp_offload(str(fsdp), fsdp_settings("fsdp", read_raw(fsdp)), "")
    if quantized_bits(trainer):
        record = strategy_record(_strategy(inputs, files)[1] or "ddp")
        sharding = "fsdp" if record.family == "fsdp" else "zero3" if record.zero_stage == 3 else ""
        tp = (files.acc_mesh or {}).get("tp") or int(trainer.get("tp_size") or 1)
        findings += check_quantized(trainer, source, sharding, tp)


def _strategy(inputs: Inputs, files) -> tuple[str, str | None]:
    """(the config file that decides the strategy, the planner's name for it): a DeepSpeed file, a Trainer
    fsdp_config, then the accelerate yaml; none: plain DDP."""
    chosen = [(str(p), strategy_of_config(k, read_raw(p), read=read_raw)) for p, k in
              ((files.deepspeed, "deepspeed"), (files.fsdp, "fsdp"), (inputs.accelerate_config, "accelerate")) if p]
    return chosen[0] if chosen else ("(no config: plain DDP)", "ddp")



def _model_findings(inputs: Inputs, files: _Files, findings: list, notes: list, ran: list) -> None:
    trainer, acc_mesh, deepspeed, fsdp = inputs.trainer, files.acc_mesh, files.deepspeed, files.fsdp
    model = _model(inputs, notes)
    fit_inputs = inputs.gpus and inputs.gpu_memory_bytes
    if model is not None:
        ran.append(f"model ({inputs.model}: layer classes to wrap, tensor-parallel degree)")
        if acc_mesh:
            findings += check_tp_degree(str(inputs.accelerate_config), acc_mesh["tp"], model[1].config, trainer)
            findings += check_tp_experts(str(inputs.accelerate_config), model[0])
        if inputs.accelerate_config:  # heads, KV heads and positions against the cp/sp split
            findings += check_sequence_split(str(inputs.accelerate_config), read_raw(inputs.accelerate_config),
                                             trainer, inputs.trainer_source, model[1].config, files.world)
        for path, kind in ((inputs.accelerate_config, "accelerate"), (fsdp, "fsdp")):
            raw = read_raw(path) if path else {}
            if not raw or (kind == "accelerate" and raw.get("distributed_type") != "FSDP"):
                continue
            settings = fsdp_settings(kind, raw)
            key = "fsdp_config.fsdp_transformer_layer_cls_to_wrap" if kind == "accelerate" else "transformer_layer_cls_to_wrap"
            findings += check_wrap_class(str(path), key, wrap_classes(settings),
                                         settings.get("fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"), model[1])
        if fit_inputs:
            ran.append(f"fit ({inputs.gpus} GPUs x {inputs.nodes} node(s))")
            file, strategy = _strategy(inputs, files)
            mesh = acc_mesh if file == str(inputs.accelerate_config) else None
            zero = read_raw(deepspeed).get("zero_optimization") if deepspeed else None
            split = split_of(read_raw(inputs.accelerate_config)) if file == str(inputs.accelerate_config) else None
            findings += check_fit(file, strategy or "ddp", model[0], inputs, mesh, zero, split)
        else:
            notes.append("fit check skipped: needs --gpus and --gpu or --gpu-memory")
    else:
        if inputs.model is None:
            notes.append("model checks skipped: no --model (and no model_name_or_path in the arguments)")
        notes.append("fit check skipped: needs --model, --gpus and --gpu or --gpu-memory")


def check_resume(trainer: dict, world: int | None, source: str) -> list[Finding]:
    """`resume_from_checkpoint` saved by ZeRO at another world size: the reshard step named."""
    from .resume import resume_problem

    problem = resume_problem(trainer.get("resume_from_checkpoint"), world) if world else None
    return [Finding("resume-world-size", source, "resume_from_checkpoint", *problem)] if problem else []


def check_files(path: Path, kind: str) -> list[Finding]:
    """The rules that need only this file (what `shardscope configs check` runs): doctor's, no
    Trainer arguments, model or GPUs."""
    field = {"accelerate": "accelerate_config", "deepspeed": "deepspeed", "fsdp": "fsdp_config"}[kind]
    return diagnose(Inputs(**{field: Path(path)}), environment=False)[0]


def _model(inputs: Inputs, notes: list[str]):
    """(planner spec, meta-device model) or None; an unloadable explicit --model is unusable input."""
    name = inputs.model
    if name is None:
        return None
    from ..model.spec import load_model_config, meta_model, spec_from_config

    try:
        config = load_model_config(name)
        return spec_from_config(config, name=name), meta_model(config)
    except UsageError as error:
        if not inputs.model_from_args:
            raise
        notes.append(f"model checks skipped: {error}")
        return None


def _dedupe(findings: list[Finding]) -> list[Finding]:
    """Drop a loader's generic message where a specific finding names the same file and key."""
    specific = {(f.file, f.key.split(".")[-1]) for f in findings if f.code != "config"}
    seen, out = set(), []
    for f in findings:
        if f.code == "config" and (f.file, f.key.split(".")[-1]) in specific:
            continue
        if (f.code, f.file, f.key, f.problem) not in seen:
            seen.add((f.code, f.file, f.key, f.problem))
            out.append(f)
    return out


# ----------------------------------------------------------------------------- recipes


# Where a launched recipe's accelerate settings come from: the yaml or a flag that overrides it.
LAUNCHED = "accelerate launch (--config_file or its flags)"


def startup_checks(namespace: dict, model: str | None = None) -> None:
    """The doctor's checks inside a launched recipe, before `TrainingArguments` exists: the DeepSpeed and
    fsdp_config files its arguments name (or accelerate's launcher passed on), the layer classes to wrap
    and mixed precision against accelerate's environment. Raises `UsageError` listing every finding."""
    env = os.environ
    inputs = Inputs(model=model, model_from_args=True, trainer=namespace, trainer_source="the recipe arguments",
                    deepspeed=Path(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]) if not namespace.get("deepspeed")
                    and env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE") else None)
    world = as_int(env.get("WORLD_SIZE"))
    inputs.gpus = world  # batch-size arithmetic only: no memory given, so no fit check
    findings, _ = diagnose(inputs, validate=False)
    if env.get("ACCELERATE_USE_FSDP", "").lower() == "true" and model:
        launched = {"fsdp_transformer_layer_cls_to_wrap": env.get("FSDP_TRANSFORMER_CLS_TO_WRAP")}
        spec_model = _model(Inputs(model=model, model_from_args=True), [])
        if spec_model is not None:
            findings += check_wrap_class(LAUNCHED, "fsdp_transformer_layer_cls_to_wrap",
                                         wrap_classes(launched), env.get("FSDP_AUTO_WRAP_POLICY"), spec_model[1])
    mixed = env.get("ACCELERATE_MIXED_PRECISION")
    if mixed and env.get("ACCELERATE_USE_DEEPSPEED", "").lower() != "true":
        findings += check_precision(LAUNCHED, {"mixed_precision": mixed}, namespace, "the recipe arguments")
    findings = failing(findings)  # notices never stop a run
    if findings:
        raise UsageError("shardscope doctor found problems, refusing to start: "
                         + " | ".join(str(f).replace("\n    ", " ") for f in findings))
