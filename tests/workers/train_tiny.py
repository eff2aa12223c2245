"""Train a tiny model (causal LM, or DINOv2 classifier) for a few steps with the Trainer; the tests launch
this under every shipped config.

Besides the profiler's summary, every rank writes `independent_count_rank{R}.json`: the bytes it holds,
counted here through each library's own accessors (element counts of ZeRO-3 partitions, DTensor local
shards, FSDP1 flat parameters, ZeRO master partitions, torch optimizer state), not by the profiler's
storage walk, so the test compares two different ways of counting the same live objects. Under DeepSpeed it
also writes what the engine's config says of its buckets (`zero_reduce_bucket_size()`, `zero_overlap_comm()`,
`zero_allgather_bucket_size()`, `zero_prefetch_bucket_size()`, `zero_param_persistence_threshold()`,
`zero_max_reuse_distance()`); under DDP, the bytes its reducer's buckets
hold (`ddp_bucket_bytes`: each trainable parameter's gradient once, in the parameter's dtype).
"""
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageClassification, HfArgumentParser, Trainer,
                          TrainerCallback, TrainingArguments)

from shardscope import ShardingProfilerCallback
from shardscope.recipes.training import end_of_run


@dataclass
class WorkerArgs:
    model: str
    samples: int = 32
    seq_len: int = 16
    lora_r: int = 0
    dtype: str = ""  # optional: load the model in this torch dtype ("bfloat16"); default: transformers' own
    logits_out: str = ""  # optional: the trained model's logits on the first 4 samples, saved by rank 0 (torch.save)
    parity: str = ""  # optional: record parity fingerprints into this folder (as `shardscope parity` asks: its env)
    defect: str = ""  # optional: a seeded defect of a user's script that parity must find (DEFECTS)


class DefectiveTrainer(Trainer):
    """A user's Trainer with one of DEFECTS (tests/test_parity_runs.py)."""

    defect = ""

    def get_train_dataloader(self):
        if self.defect != "same_batches":
            return super().get_train_dataloader()
        # every rank reads the same batches: the loader is built by hand and never sharded across ranks
        return torch.utils.data.DataLoader(self.train_dataset, batch_size=self.args.per_device_train_batch_size)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.defect == "accumulation_loss":  # divided by the accumulation the Trainer already accounts for
            return loss / self.args.gradient_accumulation_steps
        return loss


def perturb_on_rank_1(model):
    """A module whose output depends on the rank (one rank's copy of a layer drifted): layers.1.mlp, rank 1."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if rank == 1:
        model.model.layers[1].mlp.register_forward_hook(lambda module, args, output: output * 1.01)


DEFECTS = {"same_batches", "accumulation_loss", "perturb_rank_1"}


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n, seq_len, vocab):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, vocab, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


class RandomImages(torch.utils.data.Dataset):
    def __init__(self, n, size, num_labels):
        g = torch.Generator().manual_seed(0)
        self.pixels = torch.randn(n, 3, size, size, generator=g)
        self.labels = torch.randint(0, num_labels, (n,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"pixel_values": self.pixels[i], "labels": self.labels[i]}


def nbytes(t):
    t = t.to_local() if hasattr(t, "to_local") else t  # DTensor: numel() is the global size
    return t.numel() * t.element_size()


def local_param_bytes(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    flat = [m._flat_param for m in FSDP.fsdp_modules(model) if getattr(m, "_flat_param", None) is not None]
    if flat:  # FSDP1: the flat parameters own the storage; original parameters are views into them
        return sum(nbytes(p) for p in flat)
    total = 0
    for p in model.parameters():
        if hasattr(p, "ds_tensor"):  # ZeRO-3 partition, plus the full data of persistent parameters
            total += nbytes(p.ds_tensor) + nbytes(p.data)
        elif hasattr(p, "to_local"):
            total += nbytes(p.to_local())
        else:
            total += nbytes(p)
    return total


def optimizer_state_bytes(optimizer, model):
    layers = []
    while optimizer is not None:
        layers.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    masters = [t for layer in layers for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
               for t in getattr(layer, name, [])]
    local = [p.ds_tensor if hasattr(p, "ds_tensor") else p.to_local() if hasattr(p, "to_local") else p
             for p in model.parameters()]
    model_ptrs = {p.untyped_storage().data_ptr() for p in local}
    total = sum(nbytes(m) for m in masters if m.untyped_storage().data_ptr() not in model_ptrs)
    for state in layers[-1].state.values():
        total += sum(nbytes(v) for v in state.values() if torch.is_tensor(v))
    return total


class IndependentCount(TrainerCallback):
    trainer = None  # set once the Trainer exists: its model_wrapped is DeepSpeed's engine under ZeRO

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        counts = {"params_bytes": local_param_bytes(model), "optimizer_bytes": optimizer_state_bytes(optimizer, model)}
        engine = getattr(self.trainer, "model_wrapped", None)
        if type(engine).__name__ == "DeepSpeedEngine":  # the engine's own config, DeepSpeed's defaults applied
            counts.update(reduce_bucket_size=engine.zero_reduce_bucket_size(), overlap_comm=engine.zero_overlap_comm(),
                          allgather_bucket_size=engine.zero_allgather_bucket_size(),
                          prefetch_bucket_size=engine.zero_prefetch_bucket_size(),
                          persistence_threshold=engine.zero_param_persistence_threshold(),
                          max_reuse_distance=engine.zero_max_reuse_distance())
        if type(engine).__name__ == "DistributedDataParallel":  # its buckets hold each trainable gradient once
            counts["ddp_bucket_bytes"] = sum(nbytes(p) for p in engine.module.parameters() if p.requires_grad)
        Path(args.output_dir, f"independent_count_rank{rank}.json").write_text(json.dumps(counts))


def main():
    worker, args = HfArgumentParser((WorkerArgs, TrainingArguments)).parse_args_into_dataclasses()
    config = AutoConfig.from_pretrained(worker.model)
    if config.model_type == "dinov2":
        model = AutoModelForImageClassification.from_pretrained(worker.model)
        data = RandomImages(worker.samples, config.image_size, config.num_labels)
    else:
        model = AutoModelForCausalLM.from_pretrained(worker.model, **({"dtype": getattr(torch, worker.dtype)}
                                                                      if worker.dtype else {}))
        data = RandomTokens(worker.samples, worker.seq_len, config.vocab_size)
    if worker.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=worker.lora_r, target_modules=["q_proj", "v_proj"]))
    assert not worker.defect or worker.defect in DEFECTS, worker.defect
    if worker.defect == "perturb_rank_1":
        perturb_on_rank_1(model)
    if worker.parity:  # the environment `shardscope parity` launches a script with
        from shardscope.measure.parity_record import PARITY_ENV

        os.environ[PARITY_ENV] = worker.parity
    counter = IndependentCount()
    DefectiveTrainer.defect = worker.defect
    trainer = DefectiveTrainer(model=model, args=args, train_dataset=data,
                               callbacks=[ShardingProfilerCallback(), counter])
    counter.trainer = trainer
    trainer.train()
    os.environ.pop("SHARDSCOPE_PARITY", None)  # (several runs share one process)
    if trainer.is_world_process_zero():  # the losses the Trainer logged, for loss-equality checks
        Path(args.output_dir, "log_history.json").write_text(json.dumps(trainer.state.log_history))
    if worker.logits_out:  # every rank runs the forward (ZeRO-3 and FSDP gather parameters inside it)
        from shardscope.recipes.training import save_final_logits

        batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in ("input_ids", "attention_mask")}
        save_final_logits(trainer, batch, worker.logits_out)
    end_of_run()


if __name__ == "__main__":
    main()
