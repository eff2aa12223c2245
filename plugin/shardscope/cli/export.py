"""`shardscope export` arguments; the export itself is checkpoint/export.py's."""
from __future__ import annotations

from pathlib import Path

from ..checkpoint.export import DEFAULT_MAX_SHARD_SIZE, MEMORY_BOUND, export


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export", help="turn a ZeRO/FSDP sharded checkpoint into a normal save_pretrained model, in bounded memory",
        description="Consolidate a DeepSpeed ZeRO-1/2/3 or FSDP SHARDED_STATE_DICT checkpoint (a Trainer "
                    "checkpoint-N folder) into safetensors shards and their index, a folder from_pretrained "
                    "loads (LoRA: the adapter). Tensor by tensor, one shard in memory at a time; "
                    f"{MEMORY_BOUND}.")
    parser.add_argument("checkpoint", type=Path, help="checkpoint-N, global_stepN, pytorch_model_fsdp_0 or an output dir")
    parser.add_argument("out_dir", type=Path, help="new folder to create (refused if it exists)")
    parser.add_argument("--model", help="base model (folder or hub id) when the checkpoint has no config.json, "
                                        "or to override the LoRA adapter's base")
    parser.add_argument("--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE,
                        help="largest shard file (default 5GB; 5GB = 5e9 bytes, 5GiB = 5 x 2^30, a bare number is "
                             f"bytes). It bounds the memory export needs: {MEMORY_BOUND}")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="unpickle the checkpoint's files without restriction. A crafted checkpoint can then run "
                             "any code on your machine: use only for files you made or whose source you trust. "
                             "Without it, only tensors and the known DeepSpeed/DCP types are loaded.")
    parser.set_defaults(func=lambda args: export(args.checkpoint, args.out_dir, args.model, args.trust_pickle,
                                                 args.max_shard_size) and 0)
