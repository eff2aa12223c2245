"""Train one strategy's configurations one after another in one launched process, for the step-time model's
check (tests/test_time_prediction.py, benchmarks/time_prediction.py).

Each configuration (`--configs`: accumulation x checkpointing, e.g. "a1c0,a2c1") trains a fresh copy of the
model for STEPS optimizer steps with the profiler's instrumented steps early (memory 1, collectives 2, the timed
step 3) so steps 4.. are plain, and writes its summary to `<output_dir>/<config>/`. The strategy comes from the
launcher (torchrun: DDP), `--deepspeed_stage` (the Trainer's DeepSpeed integration) or `--fsdp` (FSDP2 via the
Trainer, tests/cpu_shim on CPU).
"""
import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

from shardscope import ShardingProfilerCallback
from shardscope import end_of_run
from train_tiny import RandomTokens  # the same random token data (this folder is on the path)

STEPS = 8
SAMPLED = dict(memory_step=1, comm_step=2, time_step=3)


def deepspeed_config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto"}


def training_args(opts, out: Path, accumulation: int, checkpointing: bool) -> TrainingArguments:
    extra = {}
    if opts.deepspeed_stage:
        extra["deepspeed"] = deepspeed_config(opts.deepspeed_stage)
    if opts.fsdp:
        extra.update(fsdp="full_shard" if opts.fsdp == "full_shard" else "shard_grad_op",
                     fsdp_config={"version": 2, "reshard_after_forward": opts.fsdp == "full_shard"})
    return TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=opts.micro_batch,
                             gradient_accumulation_steps=accumulation, gradient_checkpointing=checkpointing,
                             learning_rate=1e-4, use_cpu=True, report_to="none", save_strategy="no", seed=0,
                             logging_steps=1, disable_tqdm=True, dataloader_drop_last=True, **extra)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--configs", default="a1c0,a2c0,a1c1")
    p.add_argument("--micro_batch", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--deepspeed_stage", type=int, default=0)
    p.add_argument("--fsdp", choices=("", "full_shard", "shard_grad_op"), default="")
    p.add_argument("--output_dir", required=True)
    opts = p.parse_args()
    vocab = AutoConfig.from_pretrained(opts.model).vocab_size
    if opts.deepspeed_stage:  # ZeRO-3's zero.Init in from_pretrained reads DeepSpeed's own process group
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    for name in opts.configs.split(","):
        accumulation, checkpointing = int(name[1]), name[3] == "1"
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state()  # each Trainer builds its own accelerator state (DeepSpeed plugin too)
        out = Path(opts.output_dir) / name
        args = training_args(opts, out, accumulation, checkpointing)
        data = RandomTokens(opts.micro_batch * accumulation * args.world_size * STEPS, opts.seq_len, vocab)
        model = AutoModelForCausalLM.from_pretrained(opts.model)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ShardingProfilerCallback(**SAMPLED)])
        trainer.train()
        if trainer.is_world_process_zero():
            (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
        del trainer, model
    end_of_run()


if __name__ == "__main__":
    main()
