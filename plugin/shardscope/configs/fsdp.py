"""FSDP as accelerate's plugin builds it: a Trainer `fsdp_config` JSON checked through `TrainingArguments` and the
plugin the Trainer builds from it, and the one FSDP1 rule both kinds of file share (`fsdp1_sharding_problem`)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .files import ReadTracker, json_object, strings_that_should_be_values


def fsdp_plugin(**kwargs):
    """accelerate's FSDP plugin from `kwargs` and the FSDP_* environment, as a launched process builds it.

    FSDP1's rank-0 broadcast looks up an accelerator device, a property of the run rather than of the
    file, so on a machine without one that lookup is skipped."""
    from accelerate.utils import FullyShardedDataParallelPlugin, is_cuda_available, is_xpu_available

    version = int(kwargs.get("fsdp_version") or os.environ.get("FSDP_VERSION", 1))
    if version == 1 and not (is_cuda_available() or is_xpu_available()):
        kwargs.update(sync_module_states=False, cpu_ram_efficient_loading=False)
    return FullyShardedDataParallelPlugin(**kwargs)


def fsdp1_sharding_problem(key: str, asked, plugin, source: str, fix: str) -> list[str]:
    """FSDP1 wraps with `sharding_strategy or reshard_after_forward` (accelerate's Accelerator.prepare_model), and
    the plugin fills `sharding_strategy` from FSDP_SHARDING_STRATEGY or FULL_SHARD when none is passed (the
    Trainer never passes one; the launcher always exports it): a `reshard_after_forward` strategy `asked` other than
    that is silently not the one trained. `source` says where the plugin's strategy came from, `fix` what to do."""
    if plugin.fsdp_version != 1 or asked is None or plugin.sharding_strategy is None:
        return []
    if str(asked).upper() == plugin.sharding_strategy.name:
        return []
    return [f"{key}: {asked!r} is not what FSDP1 trains: accelerate wraps with its sharding_strategy, "
            f"{plugin.sharding_strategy.name} ({source}); {fix}"]


def validate_fsdp(path: Path, problems: list[str], world_size: int):
    """`TrainingArguments(fsdp=True, fsdp_config=...)`, then the FSDP plugin the Trainer builds from it."""
    config = json_object(path)
    problems += strings_that_should_be_values(config)
    if problems:
        return None
    from transformers import TrainingArguments

    tracked = ReadTracker(config)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to="none", fsdp=True, fsdp_config=tracked)
        plugin = fsdp_plugin(**args.fsdp_plugin_args)  # what Trainer.create_accelerator_and_postprocess builds
    except (ValueError, TypeError, KeyError) as error:
        problems.append(f"TrainingArguments rejects it: {error}")
        return None
    problems += fsdp1_sharding_problem(
        "reshard_after_forward", config.get("reshard_after_forward"), plugin,
        "FSDP_SHARDING_STRATEGY or its default; the Trainer's fsdp_config cannot set it",
        "use FSDP2 (an accelerate yaml with a parallelism_config for HYBRID_SHARD)")
    # keys transformers did not read for this config (unknown, or meant for the other FSDP version)
    version = config.get("version", config.get("fsdp_version", 2))
    problems += [f"{key}: not read by TrainingArguments for an FSDP{version} fsdp_config (ignored)"
                 for key in tracked.unread()]
    return args
