"""Train a DDP layer one step on gloo, keep it (as a Trainer would, until exit), then call `end_of_run()`.

Leaves `atexit_rank{R}` from an exit handler, prints a line with no newline (it must still reach the pipe), and
writes `after_end_rank{R}` only if `end_of_run()` returned.
"""
import atexit
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardscope.recipes.training import end_of_run

out = Path(sys.argv[sys.argv.index("--output_dir") + 1])
out.mkdir(parents=True, exist_ok=True)
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
model(torch.ones(2, 4)).sum().backward()
atexit.register(lambda: (out / f"atexit_rank{rank}").write_text("ran"))
print(f"rank {rank} printed before the end", end="")
end_of_run()
(out / f"after_end_rank{rank}").write_text("end_of_run returned")
