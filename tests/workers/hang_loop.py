"""A raw torch DDP loop over gloo with `ShardingProfiler` (hang_after small) and one rank made to misbehave at step
`--at`: `skip` (it skips the loop's loss all_reduce), `sleep` (it sleeps inside the step, before backward), `kill`
(it SIGKILLs itself inside the step), `slow` (every step it also busy-loops for `--slow_ms` of its own CPU time:
a straggler that never hangs), `clean` (nothing). Launched by tests/test_hang_runs.py under torchrun."""
import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from shardscope import ShardingProfiler, end_of_run

parser = argparse.ArgumentParser()
parser.add_argument("--scenario", default="clean", choices=("clean", "skip", "sleep", "kill", "slow"))
parser.add_argument("--bad_rank", type=int, default=1)
parser.add_argument("--at", type=int, default=3)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--hang_after", type=lambda v: v if v == "auto" else float(v), default="auto")
parser.add_argument("--slow_ms", type=float, default=30.0)
parser.add_argument("--output_dir", required=True)
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)
model = torch.nn.parallel.DistributedDataParallel(LlamaForCausalLM(config))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
batch = {"input_ids": torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(rank))}
batch["labels"] = batch["input_ids"]
bad = rank == args.bad_rank
with ShardingProfiler(model, optimizer, output_dir=args.output_dir, every_n_steps=2, memory_step=None,
                      comm_step=None, time_step=None, hang_after=args.hang_after) as profiler:
    for step in range(1, args.steps + 1):
        at = bad and step == args.at
        loss = model(**batch).loss
        if at and args.scenario == "sleep":
            time.sleep(3600)
        if at and args.scenario == "kill":
            time.sleep(1.0)  # (the watchdog's heartbeat has seen the last step)
            print(f"rank {rank} killed at {time.time():.3f}", flush=True)  # (how fast the launcher ends: docs)
            os.kill(os.getpid(), signal.SIGKILL)
        if bad and args.scenario == "slow":
            busy_until = time.thread_time() + args.slow_ms / 1000
            while time.thread_time() < busy_until:
                pass
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if not (at and args.scenario == "skip"):
            dist.all_reduce(loss.detach())  # the loop's own loss average, as a logging loop does
        profiler.step(batch)
end_of_run()  # barrier, destroy, and leave without gloo's exit race (pytorch/pytorch#179291)
