"""`shardscope hang DIR`: the verdict of a run's hang records (`measure/hang.py`), with each rank's stack."""
from __future__ import annotations

import json
from pathlib import Path

from ..measure import hang

STACK_FRAMES = 12  # innermost frames printed per rank (--json carries them all)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "hang", help="name the rank, the collective and the step of a hung or dead run from its hang records",
        description="Read the records the profiler's watchdog wrote into OUTPUT_DIR/shardscope_hang/ (and torch "
                    "flight-recorder dumps found there) and say where the ranks diverged: the collective some "
                    "ranks wait in, the rank(s) not there, ahead or dead, each rank's stack and step. Exit 1 when "
                    "the records show a hang or a dead rank, 0 when they show none, 2 when nothing is readable.")
    parser.add_argument("folder", type=Path, help="OUTPUT_DIR or OUTPUT_DIR/shardscope_hang")
    parser.add_argument("--json", action="store_true", help="the verdict as JSON (records included)")
    parser.set_defaults(func=run)


def run(args) -> int:
    records, unreadable = hang.read_folder(args.folder)
    result = hang.verdict(records, unreadable)
    print(json.dumps(result, indent=1, default=str) if args.json else text(result))
    if not records and unreadable:
        return 2
    return 1 if result["hang"] else 0


def text(result: dict) -> str:
    lines = [f"shardscope hang: {hang.line(result)}"]
    ranks = result["ranks"]
    if ranks:
        sources = sorted({str(hang.collectives(r)["source"]) for r in ranks.values()})
        lines.append(f"run {result['run_id']}, world size {result['world_size']}: records from rank(s) "
                     f"{', '.join(map(str, sorted(ranks)))}; collectives from: {', '.join(sources)}")
    for run_ in result["other_runs"]:
        lines.append(f"left out: records of another run ({run_['run_id']}, rank(s) "
                     f"{', '.join(map(str, run_['ranks']))})")
    for name, why in sorted(result["unreadable"].items()):
        lines.append(f"unreadable: {name}: {why}")
    for rank, record in sorted(ranks.items()):
        lines += _rank(rank, record)
    return "\n".join(lines)


def _rank(rank: int, record: dict) -> list[str]:
    running = record.get("running_s")
    head = f"rank {rank} ({record.get('event')}; host {record.get('host')}, pid {record.get('pid')}; after step " \
           f"{record.get('step')}" + (f", its next step running {running:.1f} s" if running else "") + ")"
    seen = hang.collectives(record)
    lines = ["", head, f"  last completed: {_say(seen['last_completed'])}",
             f"  waiting in: {', '.join(map(_say, seen['pending'])) or 'no collective'}"]
    if record.get("error"):
        lines.append(f"  error: {record['error']}")
    stack = record.get("stack") or []
    if stack:
        lines.append("  stack (innermost last):")
        lines += [f"    {frame}" for frame in stack[-STACK_FRAMES:]]
    return lines


def _say(collective: dict | None) -> str:
    if not collective:
        return "none recorded"
    return f"{collective['kind']} #{collective['seq']} ({collective['group']}, {collective['bytes']:,} B)"
