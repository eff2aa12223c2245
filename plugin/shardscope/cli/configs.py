"""`shardscope configs {list,path,check}`. `check` runs doctor's rules on each file alone (no Trainer
arguments, model or GPUs), so it and `shardscope doctor` give one verdict on the same file."""
from __future__ import annotations

import sys
from pathlib import Path

from ..configs.catalog import KINDS, find_config, shipped_configs
from ..configs.validate import guess_kind, validate_config
from ..doctor.diagnose import check_files
from ..doctor.rules import failing
from ..errors import UsageError


def register(subparsers) -> None:
    parser = subparsers.add_parser("configs", help="list, locate and check distributed-training configs",
                                   description="List the shipped configs, print one's installed path, or check files.")
    parser.set_defaults(func=_list)
    actions = parser.add_subparsers(dest="action")
    path = actions.add_parser("path", help="print the installed path of a shipped config")
    path.add_argument("name", help="e.g. zero3 (accelerate yaml), ds/zero3, fsdp/llama_full_shard, zero3.json")
    path.set_defaults(func=_path)
    check = actions.add_parser("check", help="check config files with the libraries that consume them and "
                                             "doctor's rules (exit 2 on any error or warning)")
    check.add_argument("files", nargs="+", type=Path)
    check.add_argument("--kind", choices=KINDS, help="the file kind, if not clear from its name and folder")
    check.set_defaults(func=_check)


def _list(args) -> int:
    import shutil
    import textwrap

    configs = shipped_configs()
    width = max(len(c.name) for c in configs)
    indent = " " * (width + 14)
    columns = max(shutil.get_terminal_size().columns, len(indent) + 40)
    for c in configs:
        line = f"{c.name:<{width}}  {c.kind:<10}  {c.description}{'  [multi-node]' if c.multinode else ''}"
        print(textwrap.fill(line, columns, subsequent_indent=indent, break_on_hyphens=False,
                            break_long_words=False))
    return 0


def _path(args) -> int:
    print(find_config(args.name).path)
    return 0


def _check(args) -> int:
    failed = []
    for file in args.files:
        try:
            kind = args.kind or (guess_kind(file) if file.is_file() else None)
            if kind in ("slurm", None):
                validate_config(file, kind)
                findings = []
            else:
                findings = check_files(file, kind)
        except UsageError as error:  # ConfigProblems, or a file that cannot be read at all
            failed += getattr(error, "problems", [str(error)])
            continue
        bad = failing(findings)
        failed += [f"{f.file}: {f.key}: {f.problem} (fix: {f.fix})" for f in bad]
        if not bad:
            print(f"ok  {file}")
        for f in findings:
            if f not in bad:
                print(f"    {f.level} [{f.code}] {f.key}: {f.problem}")
    for line in failed:
        print(f"shardscope: error: {line}", file=sys.stderr)
    return 2 if failed else 0
