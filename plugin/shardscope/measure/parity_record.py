"""Parity fingerprints: what `shardscope parity` compares, recorded by the callback of a run that parity launched.

Active only where `PARITY_ENV` names a folder (a relative one under the Trainer's `output_dir`); nothing for the user
to add. Each rank writes `rank{R}.json` there (atomically, JSON) at the end of training. Per optimizer step:
- `samples`: a digest of each row of the inputs each micro-batch trained on (`input_ids`, else `pixel_values`);
- `forward`: per module (named as in the unwrapped model), per sample, the fingerprint of its output, and the order
  in which the modules' forwards completed (a module after the modules inside it);
- `grads`: per parameter, the fingerprint of its gradient just before the optimizer step (after clipping); empty
  where the library steps inside backward and leaves none to see (DeepSpeed);
- `update`: per parameter, the fingerprint of the step's change to it (this step's values less the last step's end:
  the same under every library, DeepSpeed's step inside backward included); step 0 holds `params`, the fingerprint
  before training (a copy of what this rank holds is kept between steps: one more copy of its trainable slice);
- `loss`, `grad_norm`: what the Trainer logs (parity has it log every step).

A fingerprint is `[sum, sum of squares, abs-max, elements]` in fp64 of what this rank holds (`local_slice`: ZeRO-3's
`ds_tensor`, a DTensor's local shard, FSDP1's flat-parameter views, else the whole tensor); the comparison adds the
pieces across ranks (parity/compare.py).
The same recorder in the reference run (one process) imitates the launched world's global batch: `WORLD_ENV` scales
the Trainer's gradient accumulation by that world size; `STEPS_ENV` ends training after that many optimizer steps.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from .guard import MethodWrap, unwrap_stale
from ..safe_io import atomic_write_text

PARITY_ENV = "SHARDSCOPE_PARITY"
WORLD_ENV = "SHARDSCOPE_PARITY_WORLD"
STEPS_ENV = "SHARDSCOPE_PARITY_STEPS"
SCHEMA_VERSION = 1
# wrappers' names inside a module path: the unwrapped model's names are the ones both runs share
WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def requested() -> str | None:
    """The folder parity asked for (PARITY_ENV), or None."""
    return os.environ.get(PARITY_ENV) or None


def clean_name(name: str) -> str:
    for noise in WRAPPER_NAMES:
        name = name.replace(noise, "")
    return name.removeprefix("module.")


def fingerprint(tensor: torch.Tensor) -> list[float]:
    """[sum, sum of squares, abs-max, elements] of `tensor` in fp64 (a DTensor: its local shard)."""
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    x = tensor.detach().reshape(-1).double()
    if x.numel() == 0:
        return [0.0, 0.0, 0.0, 0]
    return [x.sum().item(), x.dot(x).item(), x.abs().max().item(), x.numel()]


def per_sample(tensor: torch.Tensor, rows: int) -> list[list[float]] | None:
    """One fingerprint per leading row, or None where the tensor does not lead with the batch's rows."""
    tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if tensor.dim() == 0 or tensor.shape[0] != rows or not tensor.is_floating_point():
        return None
    x = tensor.detach().reshape(rows, -1).double()
    return [[s, q, m, x.shape[1]] for s, q, m in zip(x.sum(1).tolist(), (x * x).sum(1).tolist(),
                                                     x.abs().amax(1).tolist() if x.shape[1] else [0.0] * rows)]


def first_tensor(output):
    """The tensor a module's output leads with (a ModelOutput's first field, a tuple's first tensor)."""
    if torch.is_tensor(output):
        return output
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if torch.is_tensor(v)), None)


def sample_digests(inputs) -> list[str]:
    """A digest of each row the micro-batch trains on."""
    rows = inputs.get("input_ids") if isinstance(inputs, Mapping) else None  # (a BatchEncoding is no dict)
    if rows is None and isinstance(inputs, Mapping):
        rows = inputs.get("pixel_values", next((v for v in inputs.values() if torch.is_tensor(v)), None))
    if rows is None:
        return []
    rows = rows.detach().cpu().contiguous()
    return [hashlib.blake2b(row.numpy().tobytes(), digest_size=8).hexdigest() for row in rows]


def local_slice(tensor) -> torch.Tensor:
    """What this rank holds of a parameter or gradient: ZeRO-3's partition (its padding zeros add nothing to a
    fingerprint), a DTensor's local shard, else the tensor (FSDP1's views into this rank's flat shard included)."""
    if hasattr(tensor, "ds_tensor"):
        return tensor.ds_tensor
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class ParityRecorder:
    """Records one rank's fingerprints (module docstring); every hook goes in through `instrument`."""

    def __init__(self, folder: Path, rank: int, world: int, instrument, facts: dict):
        self.folder, self.rank, self.instrument = Path(folder), rank, instrument
        self.record = {"schema_version": SCHEMA_VERSION, "rank": rank, "world_size": world, **facts, "steps": []}
        self.names, self.model, self.previous = {}, None, {}
        self.current, self.rows, self.done = None, 0, set()

    def start(self, trainer, model) -> None:
        """Hooks on every module's forward and on the Trainer's training_step; the parameters before training."""
        self.model = model
        self.record["steps"].append({"step": 0, "params": self.parameters(keep=True)})
        self.record["grads_visible"] = False
        for name, module in model.named_modules():
            self.names[module] = clean_name(name) or "(model)"
            self.instrument.hook(module.register_forward_hook, self.forward_done)
        if trainer is not None:
            unwrap_stale(trainer, "training_step", self.instrument.name)
            MethodWrap(self.instrument, trainer, "training_step", before=self.micro_batch, after=self.micro_batch_end)
        self.new_step(1)

    def new_step(self, number: int) -> None:
        self.current = {"step": number, "samples": [], "forward": {}, "forward_order": [], "grads": {},
                        "update": {}, "params": {}, "loss": None, "grad_norm": None}

    def micro_batch(self, model, inputs, *args, **kwargs) -> None:
        digests = sample_digests(inputs)
        self.current["samples"].append(digests)
        self.rows, self.done = len(digests), set()

    def micro_batch_end(self) -> None:
        self.rows = 0

    def forward_done(self, module, args, output) -> None:
        name = self.names.get(module)
        if not self.rows or name is None or name in self.done:  # outside training_step, or a recomputation
            return
        self.done.add(name)
        tensor = first_tensor(output)
        prints = per_sample(tensor, self.rows) if tensor is not None else None
        if prints is None:
            return
        if name not in self.current["forward"]:
            self.current["forward"][name] = {}
            self.current["forward_order"].append(name)
        for digest, value in zip(self.current["samples"][-1], prints):
            held = self.current["forward"][name].get(digest)
            self.current["forward"][name][digest] = value if held is None else [
                held[0] + value[0], held[1] + value[1], max(held[2], value[2]), held[3] + value[3]]

    def parameters(self, grads: bool = False, keep: bool = False, update: bool = False) -> dict:
        """{name: fingerprint} of every trainable parameter (`grads`: of its gradient; `update`: of its change since
        the copy last kept; `keep`: keep a copy of what this rank holds)."""
        out = {}
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            held, name = local_slice(param), clean_name(name)
            if grads:  # (ZeRO-3's gradients live in its optimizer, cleared before this is called)
                grad = getattr(param, "grad", None) if not hasattr(param, "ds_tensor") else None
                held = local_slice(grad) if grad is not None else None
            elif update:
                before = self.previous.get(name)
                held = held.detach() - before if before is not None and before.shape == held.shape else None
            if keep:
                self.previous[name] = local_slice(param).detach().clone()
            if held is not None:
                out[name] = fingerprint(held)
        return out

    def before_optimizer(self) -> None:
        with self.instrument:
            self.current["grads"] = self.parameters(grads=True)
            self.record["grads_visible"] |= bool(self.current["grads"])

    def step_end(self, number: int) -> None:
        with self.instrument:
            self.current["params"] = self.parameters()
            self.current["update"] = self.parameters(update=True, keep=True)
            self.record["steps"].append(self.current)
            self.new_step(number + 1)

    def logged(self, number: int, logs: dict) -> None:
        with self.instrument:
            for step in reversed(self.record["steps"]):
                if step["step"] == number:
                    step["loss"] = logs.get("loss", step.get("loss"))
                    step["grad_norm"] = logs.get("grad_norm", step.get("grad_norm"))
                    break

    def close(self) -> None:
        with self.instrument:
            self.record["instrument"] = self.instrument.status
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.folder / f"rank{self.rank}.json", json.dumps(self.record))
        self.instrument.remove()
        self.previous, self.names, self.model = {}, {}, None  # the kept copies and the model go with the run


def run_facts(args, trainer, model, detected: dict) -> dict:
    """What the comparison needs of the run: its precision (the Trainer's flags, accelerate's mixed precision, the
    trainable weights' dtypes), its batch shape, the strategy the profiler detected, how many data-parallel ranks it
    has (the ranks that read batches of their own: the reference's world) and its sequence split's degree."""
    mesh = detected.get("mesh") or {}
    from ..strategy import trainer_precision

    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.requires_grad})
    return {"precision": trainer_precision(args.bf16, args.fp16), "weight_dtypes": dtypes,
            "mixed_precision": str(getattr(getattr(trainer, "accelerator", None), "mixed_precision", "no")),
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "per_device_train_batch_size": args.per_device_train_batch_size, "strategy": detected.get("strategy"),
            "data_parallel": mesh.get("dp_replicate", 1) * mesh.get("dp_shard", 1) if mesh else args.world_size,
            "sequence_split": mesh.get("sp", 1) * mesh.get("cp", 1)}


def imitate_world(args) -> None:
    """In the reference run: the launched world's global batch, as gradient accumulation x its world size."""
    world = os.environ.get(WORLD_ENV)
    if world and int(world) > 1 and args.world_size == 1:
        args.gradient_accumulation_steps *= int(world)


def last_step() -> int | None:
    steps = os.environ.get(STEPS_ENV)
    return int(steps) if steps else None
