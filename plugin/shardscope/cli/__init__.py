"""The `shardscope` command: `entry.COMMANDS` (one line per subcommand -> its module), `main`, and one module per
subcommand (`configs`, `plan`, `fit`, `doctor`, `compare` for compare and report) holding its arguments and its
printing. The only layer that parses arguments (argparse) beside recipes/; it may import every other layer, and
nothing imports it but `__main__` and the console script."""
from .entry import COMMANDS, build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]
