"""`shardscope reshard` arguments; the conversion itself is checkpoint/reshard.py's."""
from __future__ import annotations

from pathlib import Path

from ..checkpoint.reshard import UNIVERSAL_SWITCH, reshard


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "reshard", help="make a ZeRO/FSDP Trainer checkpoint resumable at another number of GPUs",
        description="Turn a Trainer checkpoint (DeepSpeed ZeRO-1/2/3, or FSDP SHARDED_STATE_DICT) into one that "
                    "resumes at any world size with the optimizer state kept: ZeRO -> DeepSpeed's universal "
                    f"checkpoint (resume with {UNIVERSAL_SWITCH} in the DeepSpeed config); DCP -> checked readable "
                    "and copied (torch reshards it on load).")
    parser.add_argument("checkpoint", type=Path, help="checkpoint-N (or a Trainer output dir: its newest)")
    parser.add_argument("out_dir", type=Path, help="new folder to create (refused if it exists)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="unpickle the checkpoint's files without restriction (a crafted checkpoint can then run "
                             "any code on your machine)")
    parser.set_defaults(func=lambda args: reshard(args.checkpoint, args.out_dir, args.trust_pickle) and 0)
