"""Build DeepSpeed's CPU ops (the Adam of optimizer offload, the shared-memory communication op) into
TORCH_EXTENSIONS_DIR once, at install, with every core free, instead of inside the first run that needs
them (about 50 s on 2 cores; DeepSpeed then loads the cached build). Nothing to do on a GPU machine:
DeepSpeed builds its CUDA ops its own way."""
import sys

from deepspeed.accelerator import get_accelerator

accelerator = get_accelerator()
if accelerator.device_name() != "cpu":
    sys.exit(0)
for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
    accelerator.create_op_builder(name).load()
