"""A DeepSpeed JSON checked by DeepSpeed's own config class, after the Trainer's "auto" filling, for a world size
(no process group, no GPU), plus what DeepSpeed skips: sections that are not mappings, numbers written as strings,
keys it never reads."""
from __future__ import annotations

import importlib.util
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

from .files import ReadTracker, json_object, not_mappings, strings_that_should_be_values

# sections the Trainer and DeepSpeed read keys from (a number there crashes them instead of being reported)
DEEPSPEED_SECTIONS = ("zero_optimization", "zero_optimization.offload_optimizer", "zero_optimization.offload_param",
                      "optimizer", "optimizer.params", "scheduler", "scheduler.params", "bf16", "fp16")


def validate_deepspeed_file(path: Path, problems: list[str], world_size: int):
    """DeepSpeed's `DeepSpeedConfig` of the JSON for `world_size` ranks, `problems` appended."""
    return validate_deepspeed(json_object(path), problems, world_size)


def validate_deepspeed(config: dict, problems: list[str], world_size: int):
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
    tracked = ReadTracker(filled.config)
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
