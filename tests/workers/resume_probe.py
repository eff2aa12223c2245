"""Run a recipe as `accelerate launch` runs it, with one observing callback added to its Trainer: at train begin
(after the resumed checkpoint is loaded, before any step) every rank gathers each trained parameter's Adam
moments through the library's own accessors, and rank 0 saves them with torch.save to the file named by
`--moments_out FILE` (taken off the command line before the recipe parses it).

    accelerate launch ... tests/workers/resume_probe.py --moments_out m.pt recipes/causal_lm_sft.py ARGS...

The recipe runs unchanged (runpy, as `__main__`); only `RecipeTrainer.__init__` gains the callback, for this run
(several resumes may run one after another in one launch: tests/workers/several_runs.py).
"""
import runpy
import sys

import torch
from transformers import TrainerCallback

from shardscope.recipes import training
from shardscope.measure.state_bytes import base_optimizer


def full_moment(param, optimizer, key: str):
    """The whole `key` moment of `param`, gathered over the ranks (a collective: every rank calls it)."""
    if hasattr(param, "ds_id") or hasattr(param, "_hp_mapping"):  # DeepSpeed ZeRO-3 / ZeRO-1/2
        from deepspeed.utils import safe_get_full_optimizer_state

        return safe_get_full_optimizer_state(param, key)
    value = base_optimizer(optimizer).state[param][key]
    return value.full_tensor() if hasattr(value, "full_tensor") else value  # FSDP2: a DTensor shard


class MomentsProbe(TrainerCallback):
    def __init__(self, path: str):
        self.path = path

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        moments = {}
        for name, param in model.named_parameters():
            if param.requires_grad:
                for key in ("exp_avg", "exp_avg_sq"):
                    moments[f"{name}/{key}"] = full_moment(param, optimizer, key).detach().float().cpu().clone()
        if args.process_index == 0:
            torch.save(moments, self.path)


def main():
    flag = sys.argv.index("--moments_out")
    path = sys.argv[flag + 1]
    recipe, *rest = sys.argv[flag + 2:]
    init = training.RecipeTrainer.__init__

    def init_with_probe(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.add_callback(MomentsProbe(path))

    training.RecipeTrainer.__init__ = init_with_probe
    sys.argv = [recipe, *rest]
    try:
        runpy.run_path(recipe, run_name="__main__")
    finally:  # a later run in the same process (tests/workers/several_runs.py) gets the recipe as it was
        training.RecipeTrainer.__init__ = init


if __name__ == "__main__":
    main()
