"""Train strategies' configurations one after another in one launched process, for the step-time model's check
(tests/test_time_prediction.py, benchmarks/time_prediction.py).

For each strategy of `--strategies` (STRATEGIES: DDP from the torchrun launch, ZeRO through the Trainer's DeepSpeed
integration, FSDP2 through the Trainer with tests/cpu_shim on CPU), each configuration (`--configs`: accumulation x
checkpointing, e.g. "a1c0,a2c1") trains a fresh copy of the model for STEPS optimizer steps with the profiler's
instrumented steps early (memory 1, collectives 2, the timed step 3) so steps 4.. are plain, and writes its summary
to `<output_dir>/<strategy>/<config>/`.
"""
import argparse
import copy
import gc
import json
from pathlib import Path

from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

from shardscope import ShardingProfilerCallback
from shardscope import end_of_run
from train_tiny import RandomTokens  # the same random token data (this folder is on the path)

STEPS = 8
SAMPLED = dict(memory_step=1, comm_step=2, time_step=3)


def deepspeed_config(stage: int) -> dict:
    return {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "gradient_clipping": "auto",
            "bf16": {"enabled": "auto"}}  # the Trainer's --bf16 (off: fp32)


def fsdp2(sharding: str) -> dict:
    return dict(fsdp=sharding, fsdp_config={"version": 2, "reshard_after_forward": sharding == "full_shard"})


STRATEGIES = {"ddp": {}, **{f"zero{stage}": {"deepspeed": deepspeed_config(stage)} for stage in (1, 2, 3)},
              "fsdp_full_shard": fsdp2("full_shard"), "fsdp_shard_grad_op": fsdp2("shard_grad_op")}


def training_args(strategy: str, micro_batch: int, out: Path, accumulation: int, checkpointing: bool,
                  steps: int, precision: str = "fp32") -> TrainingArguments:
    return TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=micro_batch,
                             bf16=precision == "bf16",
                             gradient_accumulation_steps=accumulation, gradient_checkpointing=checkpointing,
                             learning_rate=1e-4, use_cpu=True, report_to="none", save_strategy="no", seed=0,
                             logging_steps=1, disable_tqdm=True, dataloader_drop_last=True,
                             **copy.deepcopy(STRATEGIES[strategy]))  # TrainingArguments fills in its dicts


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--configs", default="a1c0,a2c0,a1c1")
    p.add_argument("--micro_batch", type=int, default=2)
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: the Trainer's bf16 mixed")
    p.add_argument("--strategies", default="ddp", help="comma-separated STRATEGIES names")
    p.add_argument("--output_dir", required=True)
    p.add_argument("--warmup", action="store_true",
                   help="before each strategy's runs, train its first configuration once into <output_dir>/warmup/"
                        "<strategy>/ (the benchmark: no recorded run is its strategy's first in the process, whose "
                        "first steps ran slower)")
    p.add_argument("--steps", type=int, default=STEPS, help="optimizer steps per run (plain from step 4)")
    opts = p.parse_args()
    vocab = AutoConfig.from_pretrained(opts.model).vocab_size
    strategies = opts.strategies.split(",")
    if any("deepspeed" in STRATEGIES[s] for s in strategies):  # ZeRO-3's zero.Init reads DeepSpeed's process group
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    configs = opts.configs.split(",")
    runs = [(strategy, name, warmup) for strategy in strategies
            for name, warmup in [(configs[0], True)] * opts.warmup + [(name, False) for name in configs]]
    for strategy, name, warmup in runs:
        accumulation, checkpointing = int(name[1]), name[3] == "1"
        from accelerate.state import AcceleratorState
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        AcceleratorState._reset_state()  # each Trainer builds its own accelerator state (DeepSpeed plugin too)
        unset_hf_deepspeed_config()  # and its own DeepSpeed config (ZeRO-3 loading reads it)
        out = Path(opts.output_dir) / ("warmup" if warmup else "") / strategy / name
        args = training_args(strategy, opts.micro_batch, out, accumulation, checkpointing, opts.steps, opts.precision)
        data = RandomTokens(opts.micro_batch * accumulation * args.world_size * opts.steps, opts.seq_len, vocab)
        model = AutoModelForCausalLM.from_pretrained(opts.model)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ShardingProfilerCallback(**SAMPLED)])
        trainer.train()
        if trainer.is_world_process_zero():
            (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
        del trainer, model, args
        gc.collect()  # the previous run's engine and optimizer go before the next is built
    end_of_run()


if __name__ == "__main__":
    main()
