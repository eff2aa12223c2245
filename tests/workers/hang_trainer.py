"""A Trainer run (DDP over gloo, a tiny Llama) with `ShardingProfilerCallback(hang_after=...)` whose rank `--bad_rank`
sleeps after optimizer step `--at` (in a callback after the profiler's): the others wait in the next step's
all-reduce. Launched by tests/test_hang_runs.py under accelerate launch."""
import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from shardscope import ShardingProfilerCallback

parser = argparse.ArgumentParser()
parser.add_argument("--bad_rank", type=int, default=1)
parser.add_argument("--at", type=int, default=3)
parser.add_argument("--hang_after", type=float, default=3.0)
parser.add_argument("--output_dir", required=True)
args = parser.parse_args()


class Tokens(torch.utils.data.Dataset):
    ids = torch.randint(3, 128, (64, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class SleepAfterStep(TrainerCallback):
    def on_step_end(self, training_args, state, control, **kwargs):
        if training_args.process_index == args.bad_rank and state.global_step == args.at:
            time.sleep(3600)


config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)
training_args = TrainingArguments(args.output_dir, max_steps=8, per_device_train_batch_size=2, logging_steps=2,
                                  use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True)
profiler = ShardingProfilerCallback(memory_step=None, comm_step=None, time_step=None, hang_after=args.hang_after)
Trainer(model=LlamaForCausalLM(config), args=training_args, train_dataset=Tokens(),
        callbacks=[profiler, SleepAfterStep()]).train()
