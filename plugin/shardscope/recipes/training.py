"""A recipe's training set-up around the `Trainer`: its one fix (`RecipeTrainer`), `--auto_fit`, saving the result
(full weights under FSDP, the final logits for reload checks), one line per rank on what really ran,
and the end of the distributed run.
"""
from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

from transformers import Trainer


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


def auto_fit(fit_args, training_args, model, **shape):
    """`--auto_fit true`: `fit_training_args` keeping the global batch the arguments give (or
    `--fit_global_batch_size`); `shape` is seq_len= or image_size=. Returns the arguments to train with."""
    if not fit_args.auto_fit:
        return training_args
    from ..fit.training_args import data_parallel_size, fit_training_args

    global_batch = fit_args.fit_global_batch_size or (training_args.per_device_train_batch_size
                                                      * training_args.gradient_accumulation_steps
                                                      * data_parallel_size(training_args, model))
    return fit_training_args(training_args, model, global_batch_size=global_batch,
                             memory_budget=fit_args.fit_memory_budget, **shape)


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
    """End a distributed run whose outputs are saved: barrier, destroy the process group, and on a gloo (CPU)
    group leave the process at once, after its exit handlers, without Python's finalization.

    Why the exit: a gloo process group outlives `destroy_process_group`. DDP's reducer and FSDP's hooks keep it
    through references the garbage collector cannot follow, so its worker threads still run while Python
    finalizes. A worker that drops the last reference to a Python-owned tensor then takes the GIL, which a
    finalizing CPython refuses by ending the thread, and the process aborts with "terminate called without an
    active exception" after a successful run (the race pytorch/pytorch#179291 describes). Exit handlers (a
    logger finishing its run) still run; threads still running are not waited for. NCCL groups exit normally.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    gloo = "gloo" in str(dist.get_backend())  # "gloo", or "cpu:gloo,cuda:nccl"
    dist.barrier()
    dist.destroy_process_group()
    if gloo:
        atexit._run_exitfuncs()  # what a normal exit runs first; CPython's one way to run them early
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


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
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    split = "".join(f" {kind}_size={getattr(pc, kind + '_size')}" for kind in ("cp", "sp")
                    if pc is not None and getattr(pc, kind + "_size") > 1)
    return (f"[shardscope] rank={state.process_index} world_size={state.num_processes} "
            f"distributed_type={state.distributed_type.value} wrapped={type(trainer.model_wrapped).__name__} "
            f"local_param_fraction={local / max(full, 1):.3f}{split}")
