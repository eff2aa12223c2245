"""A raw FSDP training loop in the style of PyTorch's FSDP tutorial, on FSDP2 (`fully_shard`), profiled by shardscope.

No Trainer, no accelerate: torchrun starts the ranks, the script shards each decoder layer and then the root
with `fully_shard`, and trains with a KL penalty towards a frozen reference copy (sharded the same way, never
stepped). `ShardingProfiler(model, optimizer, frozen_models={"reference": reference})` reads the strategy from
the wrapper (FSDP2, FULL_SHARD), counts each rank's shards of the trained and the frozen model, and
`profiler.step(batch)` counts the batch's non-padding tokens; the reference forwards add FLOPs only.

    torchrun --nproc_per_node 2 examples/fsdp2_loop.py --output_dir out/fsdp2
    shardscope report out/fsdp2

With no --model a tiny random Llama is built locally (shardscope.recipes.tiny: no download); gloo on CPU, nccl on GPUs.
"""
import argparse
import itertools
import os
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from shardscope import ShardingProfiler, end_of_run

from accelerate_loop import padded_batches, tiny_model  # same folder: the data and model of the Accelerate example


def setup():
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")


def shard(model):
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def train(args, model, reference, loader, optimizer, profiler, device):
    model.train()
    tokens_fed, samples_fed = [], []  # per step, for checking what the profiler counted
    for step, batch in enumerate(itertools.islice(itertools.cycle(loader), args.steps), start=1):
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        with torch.no_grad():
            ref_logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        mask = batch["attention_mask"].unsqueeze(-1)
        kl = (F.kl_div(F.log_softmax(out.logits, -1), F.log_softmax(ref_logits, -1), log_target=True,
                       reduction="none") * mask).sum() / mask.sum()
        loss = out.loss + args.kl_weight * kl
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        profiler.step(batch)
        tokens_fed.append(int(batch["attention_mask"].sum()))
        samples_fed.append(len(batch["input_ids"]))
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f} (kl {kl.item():.4f})")
    return tokens_fed, samples_fed


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a local model folder (default: a tiny random Llama built here)")
    parser.add_argument("--output_dir", default="out/fsdp2_loop")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--kl_weight", type=float, default=0.1)
    args = parser.parse_args(argv)

    path = args.model or tiny_model(Path(args.output_dir) / "assets")  # before the process group: each rank saves
    device = setup()
    model = shard(AutoModelForCausalLM.from_pretrained(path).to(device))
    reference = shard(AutoModelForCausalLM.from_pretrained(path).to(device).requires_grad_(False).eval())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = padded_batches(model.config.vocab_size, args.batch_size, seed=dist.get_rank())  # each rank its data

    with ShardingProfiler(model, optimizer, output_dir=args.output_dir, every_n_steps=4,
                          frozen_models={"reference": reference}) as profiler:
        tokens_fed, samples_fed = train(args, model, reference, loader, optimizer, profiler, device)
    dist.barrier()
    return SimpleNamespace(model=model, optimizer=optimizer, reference=reference, tokens_fed=tokens_fed,
                           samples_fed=samples_fed)


if __name__ == "__main__":
    main()
    end_of_run()
