"""`shardscope preflight` arguments: its options, their checks (bad input: exit 2) and which check runs (the checks
are preflight/'s)."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from ..errors import UsageError
from ..units import parse_size

DEFAULT_SIZES = tuple(m * 2 ** 20 for m in (1, 4, 16, 64, 256))  # 1 MiB .. 256 MiB, as nccl-tests steps
NODE_OPTIONS = ("nnodes", "node_rank", "master_addr")

EPILOG = """\
node check (one process per node, before any launcher; by hand or `srun --ntasks-per-node 1`):
  shardscope preflight --nnodes 2 --node-rank $NODE_RANK --master-addr $NODE0 --master-port 29500 --timeout 60
full check (launched exactly like training):
  torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $NODE0 -m shardscope preflight
  accelerate launch --config_file CFG --machine_rank $NODE_RANK -m shardscope preflight
  deepspeed --hostfile H --no_local_rank --module shardscope preflight
Exit codes: 0 all joined and nothing found, 1 a member missing or a finding, 2 bad options.
docs/cluster.md ("Before the first multi-node run") has the JSON schema."""


def parse_sizes(text) -> list[int]:
    """'1MiB,4MiB' -> bytes (units.parse_size: MB = 1e6, MiB = 2**20)."""
    if isinstance(text, list):
        return text
    found = [parse_size(part, "--sizes") for part in str(text).split(",") if part.strip()]
    if not found:
        raise UsageError(f"--sizes '{text}' names no size (e.g. 1MiB,16MiB,256MiB)")
    return found


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "preflight", help="before a multi-node run: missing nodes, odd fingerprints, slow links, slow GPUs",
        description="Check the cluster before training: which node or rank never joins (named by the deadline, "
                    "nothing hangs), every difference in library versions / GPUs / NCCL variables across nodes, "
                    "collective bus bandwidth inside and across nodes, and each rank's matmul FLOP/s.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nnodes", type=int, help="node check: number of nodes")
    parser.add_argument("--node-rank", type=int, help="node check: this node's rank, 0 .. nnodes-1")
    parser.add_argument("--master-addr", help="node check: address of node 0 (it hosts the meeting point)")
    parser.add_argument("--master-port", type=int, default=29500, help="node check: port on node 0 (default 29500)")
    parser.add_argument("--hosts", help="node check: comma-separated host names by node rank, to name a missing "
                                        "node by host (SLURM: $(scontrol show hostnames | paste -sd,))")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds from the start for every member to join (default 60)")
    parser.add_argument("--output-dir", type=Path, default=Path("."),
                        help="where preflight.json goes, created if missing (default .)")
    parser.add_argument("--sizes", default=list(DEFAULT_SIZES),
                        help="message sizes, comma-separated (default 1MiB,4MiB,16MiB,64MiB,256MiB)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                        help="training dtype for the matmuls and messages (default bf16 on GPU, fp32 on CPU)")
    # For tests only: this rank computes each matmul 4 times and counts it once (compute.SLOW_FACTOR).
    parser.add_argument("--test-slow-rank", type=int, help=argparse.SUPPRESS)
    parser.set_defaults(func=run)


def options_of(args, started: float):
    """The checked `preflight.checks.PreflightOptions` (bad ones: UsageError): which check runs, and what it was
    asked."""
    from ..preflight.checks import PreflightOptions

    sizes = parse_sizes(args.sizes)
    given = [name for name in NODE_OPTIONS if getattr(args, name) is not None]
    if not 0 < args.timeout <= 86400:
        raise UsageError(f"--timeout must be between 0 and 86400 seconds, got {args.timeout:g}")
    try:  # by every process, so each node has the folder where it is not shared (as the Trainer makes its own)
        args.output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--output-dir {args.output_dir}: cannot create the folder ({error.strerror or error})")
    common = dict(timeout=args.timeout, started=started, output_dir=args.output_dir, sizes=tuple(sizes),
                  dtype=args.dtype, slow_rank=args.test_slow_rank)
    if not given:
        if args.hosts:
            raise UsageError("--hosts belongs to the node check: give --nnodes, --node-rank and --master-addr too")
        return PreflightOptions("full", **common)
    if len(given) < len(NODE_OPTIONS):
        lacking = ", ".join("--" + n.replace("_", "-") for n in NODE_OPTIONS if n not in given)
        raise UsageError(f"the node check needs --nnodes, --node-rank and --master-addr: {lacking} missing")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"--node-rank must be in 0..{args.nnodes - 1} and --nnodes at least 1, got --nnodes "
                         f"{args.nnodes} --node-rank {args.node_rank}")
    if not 0 < args.master_port < 65536:
        raise UsageError(f"--master-port must be a TCP port (1..65535), got {args.master_port}")
    if args.hosts and len(args.hosts.split(",")) != args.nnodes:
        raise UsageError(f"--hosts names {len(args.hosts.split(','))} host(s) but --nnodes is {args.nnodes}")
    return PreflightOptions("node", nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                            master_port=args.master_port,
                            hosts=tuple(args.hosts.split(",")) if args.hosts else None, **common)


def run(args) -> int:
    started = time.monotonic()  # the deadline counts from here, before torch is imported (seconds under load)
    from ..preflight.checks import run as preflight

    return preflight(options_of(args, started))
