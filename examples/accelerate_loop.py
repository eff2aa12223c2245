"""Your own Accelerate training loop, profiled by shardscope (the `*_no_trainer` pattern of transformers' examples).

Two lines added to an ordinary loop: a `ShardingProfiler` built after `accelerator.prepare(...)`, and
`profiler.step(batch)` after each optimizer step. The strategy comes from the accelerate config you launch with:

    accelerate launch --config_file accelerate_configs/ddp.yaml   examples/accelerate_loop.py --output_dir out/ddp
    accelerate launch --config_file accelerate_configs/zero3.yaml examples/accelerate_loop.py --output_dir out/zero3
    shardscope report out/ddp out/zero3

Metrics go through `accelerator.log` (to the trackers you started with `init_trackers`); each run folder gets
`shardscope_summary.json`. With no --model a tiny random Llama is built locally (shardscope.recipes.tiny: no download).
On a machine without a GPU add --use_cpu (and --num_processes 2 --mixed_precision no to the launcher).
"""
import argparse
import itertools
import os
from pathlib import Path
from types import SimpleNamespace

import torch
from accelerate import Accelerator, PartialState
from transformers import AutoModelForCausalLM

from shardscope import ShardingProfiler, end_of_run


def padded_batches(vocab: int, batch_size: int, max_len: int = 48, n: int = 64, seed: int = 0):
    """Random token rows of varied lengths, right-padded: the attention mask marks the real tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(8, max_len + 1, (1,), generator=g))
        ids = torch.zeros(max_len, dtype=torch.long)
        ids[:length] = torch.randint(3, vocab, (length,), generator=g)
        mask = (torch.arange(max_len) < length).long()
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return torch.utils.data.DataLoader(rows, batch_size=batch_size, shuffle=False)


def tiny_model(root: Path) -> Path:
    """A tiny random Llama, MLP wide enough for ZeRO-3 to shard; one folder per rank (no half-written reads)."""
    from shardscope.recipes.tiny import make_causal_lm

    path = Path(root) / f"rank{os.environ.get('LOCAL_RANK', 0)}"
    make_causal_lm(path, "llama", intermediate_size=1600)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model folder (default: a tiny random Llama built here)")
    parser.add_argument("--output_dir", default="out/accelerate_loop")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--use_cpu", action="store_true")
    args = parser.parse_args(argv)

    path = args.model or tiny_model(Path(args.output_dir) / "assets")  # before any process group: each rank saves
    if args.use_cpu:  # CPU ranks over gloo first; Accelerator() then applies the launched config (DeepSpeed too)
        PartialState(cpu=True)
    accelerator = Accelerator()
    model = AutoModelForCausalLM.from_pretrained(path)
    loader = padded_batches(model.config.vocab_size, args.batch_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    tokens_fed, samples_fed = [], []  # per step, for checking what the profiler counted
    with ShardingProfiler(model, optimizer, accelerator, output_dir=args.output_dir, every_n_steps=4) as profiler:
        model.train()
        for step, batch in enumerate(itertools.islice(itertools.cycle(loader), args.steps), start=1):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            metrics = profiler.step(batch)  # once per optimizer step; {} on steps that measure nothing
            tokens_fed.append(int(batch["attention_mask"].sum()))
            samples_fed.append(len(batch["input_ids"]))
            if metrics:
                accelerator.print(f"step {step}: loss {loss.item():.4f}, "
                                  f"{metrics['shardscope/samples_per_s']:.1f} samples/s")
    accelerator.wait_for_everyone()
    return SimpleNamespace(model=model, optimizer=optimizer, tokens_fed=tokens_fed, samples_fed=samples_fed)


if __name__ == "__main__":
    main()
    end_of_run()
