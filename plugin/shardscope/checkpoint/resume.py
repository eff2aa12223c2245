"""Resuming a Trainer checkpoint at another world size: what the checkpoint was saved by, and what the resumed
run needs. Used by the recipes before `trainer.train(resume_from_checkpoint=...)` and by `doctor`.

- A DeepSpeed universal checkpoint (`latest_universal`, written by `shardscope reshard`) loads at any world size
  once the engine's config has `"checkpoint": {"load_universal": true}`: `prepare_resume` sets it, and adds
  `SeparateSteps`: DeepSpeed 0.19.8's ZeRO-3 universal loader gives every parameter group one and the same
  Adam `step` tensor, which torch's fused/foreach Adam increments in place once per group, so each optimizer
  step advanced it by the number of groups (bias correction off from the first step after resume).
- A plain ZeRO checkpoint loads only at the world size that saved it (one `*_optim_states.pt` per rank):
  `doctor.resume.resume_problem` names the reshard step when the world sizes differ.
- An FSDP SHARDED_STATE_DICT (DCP) checkpoint reshards on load: nothing to do.
"""
from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from ..doctor.resume import resume_problem
from ..errors import UsageError


def prepare_resume(trainer, checkpoint) -> None:
    """Before `trainer.train(resume_from_checkpoint=checkpoint)`: refuse a ZeRO checkpoint saved at another world
    size (one line naming `reshard`), and switch DeepSpeed to its universal loader for a universal checkpoint."""
    if not checkpoint:
        return
    problem = resume_problem(checkpoint, trainer.args.world_size)
    if problem:
        raise UsageError("; ".join(problem))
    if not (Path(checkpoint) / "latest_universal").is_file():
        return
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    if plugin is None:
        raise UsageError(f"checkpoint '{checkpoint}' is a DeepSpeed universal checkpoint; resume it under DeepSpeed "
                         "(a ZeRO accelerate config or --deepspeed)")
    plugin.deepspeed_config.setdefault("checkpoint", {})["load_universal"] = True
    trainer.add_callback(SeparateSteps())


class SeparateSteps(TrainerCallback):
    """After the checkpoint is loaded (train begin): one `step` tensor per optimizer state, not one shared."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        import torch

        from ..measure.state_bytes import base_optimizer

        seen, base = set(), base_optimizer(optimizer)
        for entry in base.state.values() if base is not None else ():
            step = entry.get("step")
            if torch.is_tensor(step):
                if id(step) in seen:
                    entry["step"] = step.clone()
                seen.add(id(entry["step"]))
