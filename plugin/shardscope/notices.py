"""Library notices kept out of shardscope's own output (the command line's and the tiny-model helper's)."""
from __future__ import annotations

import logging


def quiet_library_notices() -> None:
    """Keep the tool's output its own: DeepSpeed announces on stdout, at import, that it fell back to the
    CPU accelerator; the commands only read its configs (training runs launched by `compare` keep it). bitsandbytes
    warns at import, on a CPU with AVX-512 bf16, that the optional `kernels` package is missing (its own CPU
    kernels run instead): `plan --quantize` only counts bytes."""
    logging.getLogger("DeepSpeed").addFilter(
        lambda record: "Setting accelerator to CPU" not in record.getMessage())
    quiet_bitsandbytes_cpu_kernels()


def quiet_bitsandbytes_cpu_kernels() -> None:
    """bitsandbytes 0.50 warns when it is imported (by transformers' Trainer, wherever it is installed) on a CPU with
    AVX-512 bf16 that the optional `kernels` package is missing; its own CPU kernels run instead. `import shardscope`
    filters that one message (the recipes' and a profiled script's output stay theirs); nothing else."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_cpu_kernels_notice)


def _not_cpu_kernels_notice(record) -> bool:
    return "Failed to load CPU gemm_4bit_forward" not in record.getMessage()
