"""Train a tiny causal LM for a few steps with the Trainer; the tests launch this under every config."""
import os
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments

from shardscope import ShardingProfilerCallback


@dataclass
class WorkerArgs:
    model: str
    samples: int = 32
    seq_len: int = 16


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n, seq_len, vocab):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, vocab, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def main():
    worker, args = HfArgumentParser((WorkerArgs, TrainingArguments)).parse_args_into_dataclasses()
    model = AutoModelForCausalLM.from_pretrained(worker.model)
    data = RandomTokens(worker.samples, worker.seq_len, model.config.vocab_size)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ShardingProfilerCallback()])
    trainer.train()
    s = trainer.accelerator.state
    print(f"WORKER rank={s.process_index} world={s.num_processes} type={s.distributed_type} "
          f"wrapped={type(trainer.model_wrapped).__name__} opt={type(trainer.optimizer).__name__}", flush=True)
    torch.distributed.barrier() if torch.distributed.is_initialized() else None


if __name__ == "__main__":
    main()
