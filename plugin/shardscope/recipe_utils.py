"""What the recipes under `recipes/` share: argument parsing (YAML + CLI), input checks, data formatting.

Recipes are scripts; anything non-trivial that two of them (or a test) need lives here so it is
written once and unit-testable without a launcher.

- `RecipeParser`: `HfArgumentParser` with `--config FILE.yaml` (values become defaults, the command
  line overrides them, unknown YAML keys are an error) and one-line errors instead of a page of usage.
  It builds the script's own dataclasses first and `TrainingArguments` last, because constructing
  `TrainingArguments` initialises the process group: input checks run in between.
- `run(main)`: a `UsageError` anywhere becomes one line on stderr and exit code 2.
- Causal LM SFT data: Alpaca prompt format, tokenisation with prompt tokens masked (-100), packing.
- Image classification data: a hub dataset or a local imagefolder, checked for classes.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from transformers import Trainer, TrainingArguments

from .errors import UsageError

IGNORE_INDEX = -100


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# --- Arguments -------------------------------------------------------------------------------------------


class RecipeParser:
    """Parse `--config recipe.yaml` plus command-line overrides into the recipe's dataclasses."""

    def __init__(self, *script_types, training_type):
        from transformers import HfArgumentParser

        self.script_types, self.training_type = script_types, training_type
        self.parser = HfArgumentParser((*script_types, training_type))
        self.parser.add_argument("--config", help="YAML file of argument values; command-line flags override it")
        self.parser.error = self._error
        self.namespace = None

    def _error(self, message):  # argparse prints ~400 lines of usage for TrainingArguments; one line is enough
        raise UsageError(f"{message} (see --help)")

    def parse(self, argv: list[str] | None = None):
        """Return the script dataclasses (no process group yet); `training_args()` builds the last one."""
        argv = sys.argv[1:] if argv is None else argv
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config")
        known, _ = pre.parse_known_args(argv)
        if known.config:
            defaults = load_yaml_config(known.config)
            actions = {action.dest: action for action in self.parser._actions}
            unknown = sorted(set(defaults) - set(actions))
            if unknown:
                raise UsageError(f"{known.config}: unknown key(s) {', '.join(unknown)}")
            for key in defaults:
                actions[key].required = False
            self.parser.set_defaults(**defaults)
        self.namespace = vars(self.parser.parse_args(argv))
        self.namespace.pop("config", None)
        return tuple(self._build(dtype) for dtype in self.script_types)

    def training_args(self):
        """Construct the `TrainingArguments` subclass; this initialises `PartialState` (the process group)."""
        # shardscope doctor's checks (DeepSpeed/FSDP files, layer classes, precision): refuse to start on a finding
        from .doctor import preflight

        preflight(self.namespace, self.namespace.get("model_name_or_path"))
        return self._build(self.training_type)

    def _build(self, dtype):
        keys = {f.name for f in dataclasses.fields(dtype) if f.init}
        try:
            return dtype(**{k: v for k, v in self.namespace.items() if k in keys})
        except (ValueError, TypeError) as error:
            if isinstance(error, UsageError):
                raise
            raise UsageError(f"invalid {dtype.__name__}: {str(error).splitlines()[0]}") from error


def load_yaml_config(path: str) -> dict:
    if not Path(path).is_file():
        raise UsageError(f"--config {path}: no such file")
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except yaml.YAMLError as error:
        raise UsageError(f"{path}: not valid YAML ({str(error).splitlines()[0]})") from error
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of argument names to values")
    return data


def run(main) -> None:
    """Call `main()`; a `UsageError` becomes one line on stderr and exit code 2.

    Then collect `main()`'s garbage (its datasets and Trainer) while pyarrow is still alive: Arrow
    threads that survive into Python's final teardown abort the process ("terminate called without an
    active exception", huggingface/datasets#7566, apache/arrow#45214) after everything was saved.
    """
    try:
        main()
    except UsageError as error:
        print(f"{Path(sys.argv[0]).name}: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    gc.collect()


@dataclass
class RecipeTrainingArguments(TrainingArguments):
    """`TrainingArguments` whose `use_cpu` defaults to True on a machine without CUDA (same command on CPU/GPU)."""

    # A plain default, not default_factory: HfArgumentParser ignores default_factory on bool fields.
    use_cpu: bool = field(default=not _cuda_available(),
                          metadata={"help": "Train on CPU (gloo). Defaults to True when no CUDA device is visible."})

    def __post_init__(self):
        if self.use_cpu and self.deepspeed and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            # `deepspeed --deepspeed ds.json` on CPU: accelerate's CPU state opens a plain gloo group but leaves
            # DeepSpeed's own comm uninitialised, so zero.Init/DeepSpeedConfig see world size 1 and assert on
            # train_batch_size. Initialise DeepSpeed's comm (gloo) first; accelerate then reuses that group.
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
        super().__post_init__()


class RecipeTrainer(Trainer):
    """`Trainer` with one fix: resuming FSDP1 from a sharded checkpoint restores the optimizer state.

    accelerate 1.15's `load_fsdp_optimizer` (FSDP1, SHARDED_STATE_DICT, DCP) loads into the template
    `FSDP.optim_state_dict(model, optimizer)` of the freshly built optimizer, which has no `exp_avg`/
    `exp_avg_sq`/`step` entries yet, so `dist_cp.load` restores none of them: the resumed run silently
    restarts Adam from zero (losses diverge from step k+2). The FSDP2 branch initialises the state first
    (torch's `get_optimizer_state_dict`); we do the same for FSDP1 (a zero-gradient, lr=0 step).
    """

    def _load_optimizer_and_scheduler(self, checkpoint):
        plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if (checkpoint and self.is_fsdp_enabled and plugin is not None and plugin.fsdp_version == 1
                and "FULL_STATE_DICT" not in str(plugin.state_dict_type)):
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(getattr(self.optimizer, "optimizer", self.optimizer))
        super()._load_optimizer_and_scheduler(checkpoint)


def gather_full_state_dict_on_save(trainer) -> None:
    """Make `trainer.save_model()` write real weights under FSDP: with SHARDED_STATE_DICT it writes none.

    Checkpoints stay sharded (fast, resumable); only the final save gathers a full state dict. Exception:
    FSDP1 on a CPU-only run, where accelerate's full gather (`get_state_dict` hard-codes
    `FullStateDictConfig(offload_to_cpu=True, rank0_only=True)`) segfaults inside torch; there the final
    weights stay sharded in the last checkpoint (`accelerate merge-weights` turns them into safetensors).
    """
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if not trainer.is_fsdp_enabled or plugin is None or "FULL_STATE_DICT" in str(plugin.state_dict_type):
        return
    if plugin.fsdp_version == 1 and trainer.args.device.type == "cpu":
        if trainer.is_world_process_zero():
            print("[shardscope] FSDP1 on CPU: final weights are not gathered (torch segfaults on that path); "
                  "save checkpoints and run `accelerate merge-weights <checkpoint>/pytorch_model_fsdp_0 <out>`",
                  flush=True)
        return
    plugin.set_state_dict_type("FULL_STATE_DICT")


def end_of_run() -> None:
    """Barrier and tear down the process group (avoids 'terminate called without an active exception')."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# --- Model checks ------------------------------------------------------------------------------------


def load_config(name_or_path: str, what: str = "model"):
    """`AutoConfig.from_pretrained` with one-line errors for a missing folder or an unreachable hub."""
    from transformers import AutoConfig

    if os.path.isdir(name_or_path) and not os.path.isfile(os.path.join(name_or_path, "config.json")):
        raise UsageError(f"{what} '{name_or_path}' is a folder without config.json")
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:
        if not os.path.exists(name_or_path) and os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false"):
            raise UsageError(f"{what} '{name_or_path}' is not a local folder and the hub cannot be reached "
                             "(HF_HUB_OFFLINE is set)") from error
        raise UsageError(f"{what} '{name_or_path}': {str(error).splitlines()[0]}") from error


def check_causal_lm(config, name_or_path: str) -> None:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UsageError(f"model '{name_or_path}' is a {config.model_type} model ({type(config).__name__}), "
                         "not a causal LM (AutoModelForCausalLM cannot load it)")


def check_dinov2(config, name_or_path: str) -> None:
    if config.model_type != "dinov2":
        raise UsageError(f"model '{name_or_path}' is a {config.model_type} model, not a Dinov2 model "
                         "(expected e.g. facebook/dinov2-base)")


MESH_ENV = {"tp": "PARALLELISM_CONFIG_TP_SIZE", "dp_shard": "PARALLELISM_CONFIG_DP_SHARD_SIZE",
            "dp_replicate": "PARALLELISM_CONFIG_DP_REPLICATE_SIZE"}  # what `accelerate launch` exports


def tensor_parallel_mesh(config, name_or_path: str, tp_size: int | None = None) -> dict | None:
    """The `{"dp_replicate", "dp_shard", "tp"}` mesh of a tensor-parallel run, or None without TP.

    The degrees come from `--tp_size` or from the launcher config's `parallelism_config` (accelerate
    exports it as PARALLELISM_CONFIG_*); with `--tp_size` alone the remaining ranks shard (FSDP2).
    Checked against the model and WORLD_SIZE before any weight loads.
    """
    env = {key: int(os.environ[var]) for key, var in MESH_ENV.items() if os.environ.get(var)}
    if tp_size is not None and env.get("tp", tp_size) != tp_size and env.get("tp", 1) > 1:
        raise UsageError(f"--tp_size {tp_size} disagrees with the launcher config's parallelism_config_tp_size "
                         f"{env['tp']}; give one of them")
    tp = tp_size if tp_size is not None else env.get("tp", 1)
    if tp < 1:
        raise UsageError(f"--tp_size must be at least 1, got {tp}")
    if tp == 1:
        return None
    for flag, strategy in (("ACCELERATE_USE_FSDP", "an FSDP"), ("ACCELERATE_USE_DEEPSPEED", "a DeepSpeed")):
        if os.environ.get(flag, "false").lower() == "true":
            raise UsageError(f"tensor parallelism was asked for under {strategy} launcher config: transformers "
                             "shards the model while loading it, so launch with accelerate_configs/tp.yaml, "
                             "fsdp_tp.yaml or hsdp_tp.yaml (distributed_type MULTI_GPU) instead")
    world = int(os.environ.get("WORLD_SIZE", 1))
    replicate = env.get("dp_replicate", 1)
    if world % (tp * replicate):
        raise UsageError(f"tp_size {tp} x dp_replicate_size {replicate} does not divide the {world} processes")
    shard = world // (tp * replicate) if tp_size is not None or "dp_shard" not in env else env["dp_shard"]
    if replicate * shard * tp != world:
        raise UsageError(f"parallelism_config: dp_replicate_size {replicate} x dp_shard_size {shard} x tp_size {tp} "
                         f"= {replicate * shard * tp}, but the launcher started {world} processes")
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads is None or heads % tp or kv_heads % tp:
        raise UsageError(f"tp_size {tp} must divide the attention heads of '{name_or_path}' "
                         f"(num_attention_heads {heads}, num_key_value_heads {kv_heads})")
    if not getattr(config, "base_model_tp_plan", None):
        raise UsageError(f"model '{name_or_path}' ({config.model_type}) has no tensor-parallel plan in transformers "
                         "(config.base_model_tp_plan); use FSDP or DeepSpeed instead")
    return {"dp_replicate": replicate, "dp_shard": shard, "tp": tp}


def distributed_config(mesh: dict):
    """transformers' `DistributedConfig` for `mesh`: TP (and FSDP2) applied while the weights load."""
    from transformers.distributed import DistributedConfig

    return DistributedConfig(tp_size=mesh["tp"], fsdp_size=mesh["dp_shard"], dp_replicate_size=mesh["dp_replicate"])


def tensor_parallel_training_args(training_args, mesh: dict) -> None:
    """Adjust `TrainingArguments` for a model sharded while loading (call before building the Trainer).

    - transformers cannot checkpoint the optimizer of such a model: checkpoints hold the model only.
    - transformers 5.23's Trainer sets accelerate's `ParallelismConfig(tp_size, dp_shard_size=all
      data-parallel ranks)` but leaves `dp_replicate_size` to the launcher's environment, so under
      HSDP x TP the replicas count twice ("Mesh should not be bigger than default world size"). We give
      accelerate one data-parallel dimension (it only splits batches with it); the model keeps its own
      replicate x shard x tp mesh.
    """
    from accelerate import ParallelismConfig

    if training_args.deepspeed:
        raise UsageError("--deepspeed with tensor parallelism: transformers shards the model while loading it, "
                         "DeepSpeed would partition it again; use accelerate_configs/fsdp_tp.yaml instead")
    if training_args.save_strategy != "no" and not training_args.save_only_model:
        training_args.save_only_model = True
        if training_args.process_index == 0:
            print("[shardscope] tensor parallel: checkpoints hold the model only (save_only_model)", flush=True)
    training_args.parallelism_config = ParallelismConfig(
        dp_replicate_size=1, dp_shard_size=mesh["dp_replicate"] * mesh["dp_shard"], tp_size=mesh["tp"])


def compact_tp_shards(model) -> int:
    """Copy tensor-parallel shards that are views of a whole checkpoint tensor; return the bytes freed.

    transformers 5.23 loads a TP shard as `full_tensor[rows].to(device)`: on a GPU that copies the
    slice, but on CPU `.to("cpu")` returns the view itself, so every column-parallel shard keeps the
    whole tensor alive (tp x the memory the mesh promises; the profiler shows it). Copying the slice
    once, in place (the same parameter objects, so ties and hooks stay), makes a CPU run hold what a
    GPU run holds. `_local_tensor` is the DTensor's shard itself (`to_local()` returns an alias).
    """
    import torch

    freed = 0
    with torch.no_grad():
        for param in model.parameters():
            local = getattr(param, "_local_tensor", None)
            if local is None or local.untyped_storage().nbytes() <= local.nbytes:
                continue
            freed += local.untyped_storage().nbytes() - local.nbytes
            local.set_(local.clone())
    return freed


# --- Causal LM SFT data ------------------------------------------------------------------------------

PROMPT_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                     "context. Write a response that appropriately completes the request.\n\n"
                     "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                   "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
ALPACA_REQUIRED = ("instruction", "output")  # `input` is optional (empty when absent)


def format_prompt(record: dict) -> str:
    """The Stanford Alpaca prompt (with or without the `input` block); the response follows it."""
    if record.get("input"):
        return PROMPT_WITH_INPUT.format(instruction=record["instruction"], input=record["input"])
    return PROMPT_NO_INPUT.format(instruction=record["instruction"])


def load_dataset_checked(name: str, split: str, required: tuple[str, ...], config_name: str | None = None):
    """Load a hub dataset or a local .json/.jsonl file, and check that `required` columns exist."""
    import datasets

    local = Path(name).suffix in (".json", ".jsonl")
    if local and not Path(name).is_file():
        raise UsageError(f"dataset '{name}': no such file")
    try:
        if local:
            dataset = datasets.load_dataset("json", data_files={split: name}, split=split)
        else:
            dataset = datasets.load_dataset(name, config_name, split=split)
    except Exception as error:  # datasets raises many types; the first line says what went wrong
        raise UsageError(f"dataset '{name}' (split '{split}') could not be loaded: "
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from error
    missing = [c for c in required if c not in dataset.column_names]
    if missing:
        raise UsageError(f"dataset '{name}' has no column(s) {', '.join(repr(c) for c in missing)} "
                         f"(columns: {', '.join(dataset.column_names)}; expected {', '.join(required)})")
    return dataset


def tokenize_sft(record: dict, tokenizer, max_length: int) -> dict:
    """Token ids for prompt + response + EOS; labels are -100 on the prompt (and BOS) so only the response trains.

    Prompt and response are tokenised separately so the boundary is exact (no BPE merge across it).
    """
    prompt_ids = tokenizer(format_prompt(record), add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(str(record["output"]), add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    input_ids = (bos + prompt_ids + response_ids + eos)[:max_length]
    n_masked = min(len(bos) + len(prompt_ids), len(input_ids))
    labels = [IGNORE_INDEX] * n_masked + input_ids[n_masked:]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def pack(batch: dict, block_size: int) -> dict:
    """Concatenate tokenised examples and cut them into `block_size` blocks (the remainder is dropped).

    Use with `dataset.map(pack, batched=True)`; labels keep their -100 prompt masks. Attention crosses
    example boundaries inside a block (the usual cheap packing).
    """
    out = {}
    for key in ("input_ids", "attention_mask", "labels"):
        flat = [token for example in batch[key] for token in example]
        n = len(flat) // block_size * block_size
        out[key] = [flat[i:i + block_size] for i in range(0, n, block_size)]
    return out


def prepare_sft_dataset(raw, tokenizer, max_length: int, packing: bool):
    """Tokenise (masking prompts), drop examples with no response token left, optionally pack."""
    dataset = raw.map(tokenize_sft, fn_kwargs=dict(tokenizer=tokenizer, max_length=max_length),
                      remove_columns=raw.column_names, desc="tokenising")
    dataset = dataset.filter(lambda ex: any(label != IGNORE_INDEX for label in ex["labels"]), desc="dropping "
                             "prompts longer than max_seq_length")
    if packing:
        dataset = dataset.map(pack, batched=True, fn_kwargs=dict(block_size=max_length), desc="packing")
    if len(dataset) == 0:
        raise UsageError(f"no training examples left after tokenising to max_seq_length={max_length}")
    return dataset


# --- Image classification data -----------------------------------------------------------------------


def load_image_dataset(name: str, train_split: str, eval_split: str | None, eval_fraction: float, seed: int):
    """Return (train, eval, class_names) from a hub dataset or a local imagefolder (`<dir>/[split/]<class>/*.jpg`).

    Without an eval split, `eval_fraction` of train is held out.
    """
    import datasets

    local = os.path.isdir(name)
    if not local and (name.startswith((".", "/", "~")) or name.count("/") > 1):  # a path, not a hub name
        raise UsageError(f"dataset '{name}': no such folder")
    try:
        data = datasets.load_dataset("imagefolder", data_dir=name) if local else datasets.load_dataset(name)
    except Exception as error:
        hint = " (expected <dir>/<class>/<image> or <dir>/<split>/<class>/<image>)" if local else ""
        raise UsageError(f"dataset '{name}' could not be loaded{hint}: {type(error).__name__}: "
                         f"{str(error).splitlines()[0] if str(error) else ''}") from error
    if train_split not in data:
        raise UsageError(f"dataset '{name}' has no split '{train_split}' (splits: {', '.join(data)})")
    train = data[train_split]
    label = train.features.get("label")
    if "image" not in train.column_names or not isinstance(label, datasets.ClassLabel) or label.num_classes < 2:
        where = f"image folder '{name}'" if local else f"dataset '{name}'"
        raise UsageError(f"{where} has no classes: expected an 'image' column and a 'label' class column with "
                         f"at least 2 classes (an imagefolder needs one sub-folder per class); "
                         f"columns: {', '.join(train.column_names)}")
    if eval_split and eval_split in data:
        evaluation = data[eval_split]
    else:
        parts = train.train_test_split(test_size=eval_fraction, seed=seed, stratify_by_column="label")
        train, evaluation = parts["train"], parts["test"]
    return train, evaluation, label.names


def image_transform(processor, train: bool):
    """`set_transform` function: PIL images -> processor pixel values (random horizontal flip when training)."""
    import torch
    from PIL import ImageOps

    def transform(batch):
        images = [image.convert("RGB") for image in batch["image"]]
        if train:
            images = [ImageOps.mirror(im) if torch.rand(()) < 0.5 else im for im in images]
        return {"pixel_values": processor(images, return_tensors="pt")["pixel_values"], "labels": batch["label"]}

    return transform


def collate_images(examples):
    import torch

    return {"pixel_values": torch.stack([e["pixel_values"] for e in examples]),
            "labels": torch.tensor([e["labels"] for e in examples])}


def accuracy(eval_pred) -> dict:
    import numpy as np

    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, axis=-1) == labels).mean())}


# --- End of training ---------------------------------------------------------------------------------


def save_outputs(trainer, processor, logits_batch: dict | None = None) -> None:
    """Save the trained model (ZeRO-3 gathers 16-bit weights, FSDP a full state dict, LoRA adapters only)
    with its tokenizer or image processor; with `logits_batch`, also the final logits on it (for reload
    checks); then end the distributed run."""
    out = trainer.args.output_dir
    if logits_batch is not None:
        save_final_logits(trainer, logits_batch, f"{out}/final_logits.pt")
    gather_full_state_dict_on_save(trainer)
    trainer.save_model()
    if trainer.is_world_process_zero():
        processor.save_pretrained(out)
    end_of_run()


def save_final_logits(trainer, batch: dict, path: str | Path) -> None:
    """Run the trained (wrapped: DDP/FSDP/DeepSpeed) model on `batch` on every rank; rank 0 saves the logits.

    Every rank must call this (ZeRO-3 and FSDP gather parameters inside forward). Used to check that
    the saved weights reproduce the in-memory model.
    """
    import torch

    model = trainer.model_wrapped
    was_training = model.training
    model.eval()
    device = trainer.args.device
    with torch.no_grad():
        outputs = model(**{k: v.to(device) for k, v in batch.items() if k != "labels"})
    model.train(was_training)
    if trainer.is_world_process_zero():
        torch.save({"batch": {k: v.cpu() for k, v in batch.items()}, "logits": outputs.logits.float().cpu()}, path)


def describe_run(trainer) -> str:
    """One line per rank saying what really ran: world size, strategy, wrapper and parameter share held.

    `local_param_fraction` counts the parameter elements this rank stores (FSDP2 DTensor shards, ZeRO-3
    `ds_tensor` partitions, FSDP1 flat-parameter shards) over the full count: ~1/world when sharded, 1 when not.
    """
    state = trainer.accelerator.state
    local = full = 0
    flat_params = [m._flat_param for m in trainer.model_wrapped.modules() if getattr(m, "_flat_param", None) is not None]
    for flat in flat_params:  # FSDP1: the FlatParameter shards (original params are views into them)
        local, full = local + flat.numel(), full + flat._unpadded_unsharded_size.numel()
    for param in [] if flat_params else trainer.model_wrapped.parameters():
        if hasattr(param, "ds_tensor"):  # DeepSpeed ZeRO-3 partition; persistent (small) params stay whole
            held = param.ds_numel if getattr(param, "ds_persist", False) else param.ds_tensor.numel()
            local, full = local + held, full + param.ds_numel
        elif hasattr(param, "to_local"):  # FSDP2 DTensor
            local, full = local + param.to_local().numel(), full + param.numel()
        else:
            local, full = local + param.numel(), full + param.numel()
    return (f"[shardscope] rank={state.process_index} world_size={state.num_processes} "
            f"distributed_type={state.distributed_type.value} wrapped={type(trainer.model_wrapped).__name__} "
            f"local_param_fraction={local / max(full, 1):.3f}")
