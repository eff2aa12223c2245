"""`shardscope` command line: COMMANDS names the module of each subcommand; each defines `register(subparsers)`."""
from __future__ import annotations

import argparse
import os
import sys
import traceback

from .. import __version__
from ..errors import UsageError
from ..notices import quiet_library_notices

# Each command -> the module (below shardscope) that defines `register(subparsers)` for it; each registered
# parser sets `func(args) -> int`. A run imports only its own command's module (`plan` does not import doctor's).
# One line per command: the one way to add one.
COMMANDS = {
    "configs": "cli.configs",
    "plan": "cli.plan",
    "fit": "cli.fit",
    "calibrate": "cli.calibrate",
    "compare": "cli.compare",
    "report": "cli.compare",
    "doctor": "cli.doctor",
    "export": "cli.export",
    "reshard": "cli.reshard",
    "preflight": "cli.preflight",
    "hang": "cli.hang",
    "parity": "cli.parity",
}

DESCRIPTION = """\
Pick, check and measure a distributed-training strategy (DDP, FSDP, DeepSpeed ZeRO, tensor parallel)
for the Hugging Face Trainer and `accelerate launch`: how much memory each strategy needs per GPU
before you launch, which config mistakes will stop a run, and what each rank really held afterwards.

examples:
  shardscope configs                                    # list the shipped accelerate/DeepSpeed/FSDP configs
  shardscope plan --model mistral-7b --gpus 4 --gpu A100-80      # memory per GPU of every strategy
  shardscope fit --model llama-2-7b --gpus 8 --gpu H100 --seq-len 4096 --global-batch 64  # what fits, fastest where the model can tell
  shardscope calibrate --model ./my_model --gpus 8 --gpu H100 --global-batch 64 --recipe recipes/causal_lm_sft.py  # measure it here
  shardscope doctor --accelerate-config $(shardscope configs path zero3) --model mistral-7b --gpus 4  # mistakes
  shardscope compare --recipe recipes/causal_lm_sft.py --configs ddp zero3 -- --config my.yaml
  shardscope report runs/ddp runs/zero3                 # tables and plots from finished runs
  shardscope export output/checkpoint-100 model_out     # sharded checkpoint -> from_pretrained folder
  shardscope reshard output/checkpoint-100 ckpt_any     # a checkpoint that resumes at another world size
  shardscope preflight --nnodes 2 --node-rank 0 --master-addr node0  # before the first multi-node run
  shardscope hang output/                               # a hung or dead run: which rank, collective, step
  shardscope parity --config zero3 --script train.py -- --model ./m   # sharded = one process? where not

`shardscope COMMAND --help` gives each command's options."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of `command` alone (a name in COMMANDS)."""
    parser = argparse.ArgumentParser(prog="shardscope", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"shardscope {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    import importlib

    modules = [COMMANDS[command]] if command in COMMANDS else dict.fromkeys(COMMANDS.values())
    for name in modules:
        importlib.import_module(f"shardscope.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 ok; 1 findings, failed runs or nothing fits; 2 bad input or usage (one line), or a crash."""
    quiet_library_notices()
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    try:
        return args.func(args) or 0
    except UsageError as error:
        print(f"shardscope: error: {error}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader stopped early (`| head`): end quietly, as a tool killed by SIGPIPE does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception:  # a bug, not a finding: its traceback is for the report, and 2 keeps it apart from 1
        traceback.print_exc()
        print(f"shardscope: internal error in '{args.command}' (a bug: please report it with the traceback above)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
