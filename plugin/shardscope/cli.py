"""`shardscope` command line: each subcommand lives in its own module and registers itself here."""
from __future__ import annotations

import argparse
import sys

from . import __version__
from .errors import UsageError

# Modules that define `register(subparsers)`; each registered parser sets `func(args) -> int`.
SUBCOMMAND_MODULES = ["configs_cli", "plan_cli", "compare", "doctor", "export"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardscope", description=__doc__)
    parser.add_argument("--version", action="version", version=f"shardscope {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    import importlib

    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"shardscope.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except UsageError as error:
        print(f"shardscope: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
