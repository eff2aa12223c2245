"""A recipe's arguments and the checks on them, all made before any process group or weight exists.

- `RecipeParser`: `HfArgumentParser` with `--config FILE.yaml` (values become defaults, the command
  line overrides them, unknown YAML keys are an error) and one-line errors instead of a page of usage.
  It builds the script's own dataclasses first and `TrainingArguments` last, because constructing
  `TrainingArguments` initialises the process group: input checks (and `shardscope.doctor.diagnose.startup_checks`,
  which the recipe calls itself) run in between.
- `RecipeTrainingArguments`: `TrainingArguments` that runs the same command on a CPU-only machine.
- `FitArguments`: `--auto_fit true` and its budget (applied by `recipes/training.py`'s `auto_fit`).
- `check_causal_lm`, `check_dinov2`: the model is one the recipe can train (its config is read by `model_spec.load_model_config`).
- `run(main)`: a `UsageError` anywhere becomes one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import TrainingArguments

from ..errors import UsageError
from ..measure.collective_log import record_by_default
from ..safe_io import load_yaml


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


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
            unknown = sorted(str(key) for key in set(defaults) - set(actions))
            if unknown:
                raise UsageError(f"{known.config}: unknown key(s) {', '.join(unknown)}")
            defaults = typed_defaults(self.parser, defaults, known.config)
            for key in defaults:
                actions[key].required = False
            self.parser.set_defaults(**defaults)
        self.namespace = vars(self.parser.parse_args(argv))
        self.namespace.pop("config", None)
        return tuple(self._build(dtype) for dtype in self.script_types)

    def training_args(self):
        """Construct the `TrainingArguments` subclass; this initialises `PartialState` (the process group).

        Recipes call `shardscope.doctor.diagnose.startup_checks(parser.namespace, model)` just before this."""
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
    data = load_yaml(path, "--config") or {}  # bounded: size, UTF-8, nesting, aliases
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of argument names to values")
    return data


def typed_defaults(parser, values: dict, source: str) -> dict:
    """YAML values converted as the command line converts them (a YAML default skips argparse's `type`):
    `max_seq_length: 95.5` or `max_steps: [1, 2]` is refused here, not found later as a crash."""
    # the annotations as written (HfArgumentParser rewrites the fields' `type`, e.g. `dict | str` to `str`)
    annotations = {k: str(v) for dtype in parser.dataclass_types for cls in reversed(dtype.__mro__)
                   for k, v in getattr(cls, "__annotations__", {}).items()}
    actions = {action.dest: action for action in parser._actions}
    typed = {}
    for key, value in values.items():
        action, many = actions[key], actions[key].nargs in ("+", "*")
        if value is None or (isinstance(value, dict) and "dict" in annotations.get(key, "")):
            typed[key] = value  # unset, or a dict-valued TrainingArguments field (deepspeed, fsdp_config, ...)
            continue
        if isinstance(value, dict) or (isinstance(value, list) and not many):
            raise UsageError(f"{source}: {key}: expected a single value, got {value!r}")
        convert = action.type or str
        try:
            typed[key] = [convert(str(v)) for v in value] if isinstance(value, list) else convert(str(value))
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            expected = {int: "an integer", float: "a number"}.get(convert, "true or false" if action.const is True
                                                                  else "a value of its type")
            raise UsageError(f"{source}: {key}: expected {expected}, got {value!r}") from None
        if action.choices is not None and any(v not in action.choices for v in (
                typed[key] if isinstance(value, list) else [typed[key]])):
            raise UsageError(f"{source}: {key}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return typed


def run(main) -> None:
    """Call `main()` (torch's flight recorder on first: `measure/collective_log.py`); a `UsageError` becomes one line
    on stderr and exit code 2.

    Then collect `main()`'s garbage (its datasets and Trainer) while pyarrow is still alive: Arrow
    threads that survive into Python's final teardown abort the process ("terminate called without an
    active exception", huggingface/datasets#7566, apache/arrow#45214) after everything was saved.
    """
    record_by_default()  # torch's flight recorder, before the Trainer's arguments create the process group
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


@dataclass
class FitArguments:
    """`--auto_fit true`: shardscope chooses the micro-batch, accumulation and checkpointing (`fit_training_args`)."""

    auto_fit: bool = field(default=False, metadata={
        "help": "Choose per_device_train_batch_size, gradient_accumulation_steps and gradient_checkpointing with "
                "shardscope's planner, keeping the global batch; every rank applies rank 0's decision"})
    fit_memory_budget: str | None = field(default=None, metadata={
        "help": "Memory per device for --auto_fit, e.g. 2GB or 20GiB; required on CPU, default on CUDA: the "
                "smallest free device memory over the ranks"})
    fit_global_batch_size: int | None = field(default=None, metadata={
        "help": "Samples per optimizer step to keep under --auto_fit; default: per_device_train_batch_size x "
                "gradient_accumulation_steps x data-parallel size as given"})


# --- Model checks ------------------------------------------------------------------------------------


def check_causal_lm(config, name_or_path: str) -> None:
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UsageError(f"model '{name_or_path}' is a {config.model_type} model ({type(config).__name__}), "
                         "not a causal LM (AutoModelForCausalLM cannot load it)")


def check_dinov2(config, name_or_path: str) -> None:
    if config.model_type != "dinov2":
        raise UsageError(f"model '{name_or_path}' is a {config.model_type} model, not a Dinov2 model "
                         "(expected e.g. facebook/dinov2-base)")
