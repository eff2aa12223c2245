"""DPO with TRL, profiled by shardscope: the reference model is counted, a preference pair is one sample.

TRL's `DPOTrainer` keeps a frozen reference model beside the one it trains (a second full copy under DDP, its
own DeepSpeed engine under ZeRO-3; with a LoRA `peft_config`, the same model run with the adapter disabled).
`ShardingProfilerCallback` finds it and reports it per rank as `frozen_models.reference`, a memory category of
its own in `shardscope report`. Samples are what the Trainer counts (pairs), tokens those the policy trains on
(the reference pass adds FLOPs, not tokens).

    accelerate launch --config_file accelerate_configs/ddp.yaml examples/trl_dpo.py --output_dir out/dpo_ddp
    accelerate launch --config_file accelerate_configs/zero3.yaml examples/trl_dpo.py --output_dir out/dpo_zero3
    shardscope report out/dpo_ddp out/dpo_zero3

With no --model it builds a tiny random Llama and a preference set locally (shardscope.recipes.tiny: no download).
On a machine without a GPU add --use_cpu (and --num_processes 2 --mixed_precision no to the launcher).
"""
import argparse
import os
import random
from pathlib import Path

from shardscope import ShardingProfilerCallback

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "bird", "rock", "star"]


def preference_pairs(n: int, seed: int = 0):
    """`n` prompt / chosen / rejected rows of a toy task: repeat three words (chosen) rather than shuffle them."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        picked = rng.sample(WORDS, rng.randint(2, 5))  # varied lengths: the batches carry padding
        shuffled = picked[1:] + picked[:1]
        rows.append({"prompt": f"Repeat: {' '.join(picked)}\n", "chosen": " ".join(picked),
                     "rejected": " ".join(shuffled)})
    return Dataset.from_list(rows)


def tiny_model(root: Path) -> Path:
    """A tiny random Llama with its tokenizer; its MLP is wide enough for ZeRO-3 to shard (> 1e5 elements).
    Each rank builds the same one (same random initialisation) in its own folder: no rank reads a half-written file."""
    from shardscope.recipes.tiny import make_sft_assets

    return make_sft_assets(Path(root) / f"rank{os.environ.get('LOCAL_RANK', 0)}", "llama", n=64,
                           intermediate_size=1600)["model"]


def build_trainer(model_path, output_dir, max_steps=8, lora=False, use_cpu=False, callbacks=(), samples=64,
                  profiler=None):
    """A `DPOTrainer` with the shardscope callback attached (`profiler`, default `ShardingProfilerCallback()`),
    plus `callbacks`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    config = DPOConfig(output_dir=str(output_dir), max_steps=max_steps, per_device_train_batch_size=2,
                       logging_steps=4, learning_rate=1e-4, max_length=64, bf16=not use_cpu, use_cpu=use_cpu,
                       gradient_checkpointing=False, report_to="none", save_strategy="no",
                       include_num_input_tokens_seen="non_padding")
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    model = AutoModelForCausalLM.from_pretrained(model_path)
    return DPOTrainer(model=model, args=config, train_dataset=preference_pairs(samples), processing_class=tokenizer,
                      peft_config=peft_config,
                      callbacks=[profiler or ShardingProfilerCallback(), *callbacks])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model folder (default: a tiny random Llama built here)")
    parser.add_argument("--output_dir", default="out/trl_dpo")
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter; the reference is the base model")
    parser.add_argument("--use_cpu", action="store_true")
    args = parser.parse_args(argv)
    model = args.model or tiny_model(Path(args.output_dir) / "assets")
    trainer = build_trainer(model, args.output_dir, args.max_steps, args.lora, args.use_cpu)
    trainer.train()
    return trainer


if __name__ == "__main__":
    from shardscope import end_of_run

    main()
    end_of_run()
