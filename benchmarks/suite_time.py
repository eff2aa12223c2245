"""How long `make test` and `make demo` take, from real runs: benchmarks/results/suite_time.md keeps one row per
recorded run (date, the commit it ran, the machine, `nproc`, from a fresh clone or not, what it printed) and, for
each target, the median of its recorded runs, which README.md shows (benchmarks/render_docs.py places it; its
`--check` judges each row by its own commit).

    python benchmarks/suite_time.py record LOG [--fresh-clone] [--commit SHA]  # a `make test` log (of HEAD unless
                                                                  # --commit): pytest's summary line
    python benchmarks/suite_time.py run test|demo [--fresh-clone]  # run `make TARGET` here (or in a fresh clone
                                                                  # of this checkout's HEAD), time it and record it

A row's seconds: with `record`, the time pytest printed ("N passed, M skipped ... in S s"); with `run`, the wall
clock of `make TARGET` (the install included when the venv is not there yet: a fresh clone has none), pytest's
line kept beside it. A run with failures is not recorded. Delete rows of runs that no longer describe the suite.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_docs.stamped: the measured-at line
from render_docs import git, machine, stamped  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# render_docs.stale: the whole suite and the demo, each row at its own commit (the stamp: when the file was written)
MEASURES = ("plugin", "tests", "recipes", "scripts/demo.sh", "Makefile", "pyproject.toml")
OUT = ROOT / "benchmarks" / "results" / "suite_time.md"
SUMMARY = re.compile(r"(?:(\d+) failed, )?(\d+) passed(?:, (\d+) skipped)?(?:, (\d+) \w+)*(?:, (\d+) errors?)?"
                     r" in ([\d.]+)s")
COLUMNS = ("target", "date", "commit", "machine", "nproc", "load", "fresh", "passed", "skipped", "seconds", "printed")
BEFORE_COMMITS = ("commit", "machine")  # rows recorded before these columns: "-" (not recorded)
HEADER = ["| target | date | commit | machine | nproc | 1-min load at the end | fresh clone | passed | skipped | seconds "
          "| printed |", "| --- " * len(COLUMNS) + "|"]


class RecordError(Exception):
    """A log that does not say what a recorded run must."""


def pytest_line(log: str) -> dict:
    """passed, skipped, seconds and the line itself, from the last pytest summary line of `log`."""
    found = [m for m in SUMMARY.finditer(log)]
    if not found:
        raise RecordError("no pytest summary line ('N passed ... in S s') in the log")
    last = found[-1]
    failed, passed, skipped, _, errors, seconds = last.groups()
    if int(failed or 0) or int(errors or 0):
        raise RecordError(f"the run failed: {last.group(0)}")
    return {"passed": int(passed), "skipped": int(skipped or 0), "seconds": float(seconds), "printed": last.group(0)}


def duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def read_rows(text: str) -> list[dict]:
    """The recorded rows (a file written before rows kept their commit and machine: those read as "-")."""
    older = [c for c in COLUMNS if c not in BEFORE_COMMITS]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in ("test", "demo") and len(cells) in (len(COLUMNS), len(older)):
            rows.append(dict(zip(COLUMNS, cells)) if len(cells) == len(COLUMNS)
                        else {**dict.fromkeys(BEFORE_COMMITS, "-"), **dict(zip(older, cells))})
    return rows


def summary(rows: list[dict], target: str) -> str:
    """One line: the median of the target's recorded runs, with what they ran on."""
    runs = [r for r in rows if r["target"] == target]
    if not runs:
        return f"not recorded yet (`python benchmarks/suite_time.py run {target}`)"
    median = statistics.median(float(r["seconds"]) for r in runs)
    cores = "/".join(sorted({r["nproc"] for r in runs}))
    fresh = sum(r["fresh"] == "yes" for r in runs)
    freshness = {len(runs): "from a fresh clone", 0: "the venv already built"}.get(fresh, f"{fresh} from a fresh clone")
    where = (f"one run on a {cores}-core machine" if len(runs) == 1 else
             f"median of {len(runs)} runs on {cores}-core machines") + f", {freshness}"
    if target == "demo":
        return f"{duration(median)} ({where})"
    last = runs[-1]
    return f"{int(last['passed']):,} passed, {last['skipped']} skipped in {duration(median)} ({where})"


def render(rows: list[dict]) -> str:
    lines = ["# `make test` and `make demo`: time of real runs", "",
             "Written by `benchmarks/suite_time.py` (`record` a `make test` log, or `run` a target). README.md shows "
             "the parts below (benchmarks/render_docs.py).", ""]
    for target in ("test", "demo"):
        lines += [f"<!-- part:{target} -->", summary(rows, target), f"<!-- /part:{target} -->", ""]
    lines += HEADER + ["| " + " | ".join(r[k] for k in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def record(out: Path, target: str, fresh: bool, seconds: float | None, log: str, date: str | None = None,
           load: str | None = None, commit: str | None = None) -> str:
    """Add one run to `out` and rewrite it; returns the target's new summary line. `load`: the 1-min load average
    when the run ended (now, by default: right for `run`; give it with `record` or leave it unknown); `commit`: the
    one the run ran (default HEAD: `run` clones HEAD); the machine is this one."""
    counts = pytest_line(log) if target == "test" else {"passed": "-", "skipped": "-", "printed": "-"}
    if seconds is None:
        if target != "test":
            raise RecordError("give the run's --seconds: only a pytest log says its own time")
        seconds = counts["seconds"]
    rows = read_rows(out.read_text()) if out.is_file() else []
    rows.append({"target": target, "date": date or datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
                 "commit": commit or (git("rev-parse", "--short=12", "HEAD") or "-").strip(), "machine": machine().replace("|", "/"),
                 "nproc": str(os.cpu_count()), "load": load or f"{os.getloadavg()[0]:.1f}",
                 "fresh": "yes" if fresh else "no", "passed": str(counts["passed"]),
                 "skipped": str(counts["skipped"]), "seconds": f"{seconds:.1f}",
                 "printed": str(counts["printed"]).replace("|", "/")})
    sys.path.insert(0, str(ROOT / "plugin"))
    from shardscope.safe_io import atomic_write_text

    atomic_write_text(out, stamped(render(rows), __file__, MEASURES), "results")
    return summary(rows, target)


def run(target: str, fresh: bool, installed: bool = False) -> tuple[float, str]:
    """(wall seconds, output) of `make TARGET` in this checkout, or in a fresh clone of its HEAD; `installed`: take
    the venv as it is (make's `-o` on its install stamp), e.g. a worktree whose `.venv` links to another's."""
    where = ROOT
    if fresh:
        where = Path(tempfile.mkdtemp(prefix="suite-time-")) / "shardscope"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(where)], check=True)
    start = time.perf_counter()
    done = subprocess.run(["make", *(["-o", ".venv/.installed"] if installed else []), target], cwd=where,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    output = done.stdout + done.stderr
    (Path(tempfile.gettempdir()) / f"suite_time_{target}.log").write_text(output)
    if done.returncode:
        raise RecordError(f"make {target} exited {done.returncode}:\n{output[-3000:]}")
    return seconds, output


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="record a `make test` log")
    rec.add_argument("log", type=Path)
    rec.add_argument("--target", choices=("test", "demo"), default="test")
    rec.add_argument("--seconds", type=float, help="the run's wall time (a demo log does not say it)")
    rec.add_argument("--date", help="when the run ended, YYYY-MM-DD HH:MM (default: now)")
    rec.add_argument("--load", default="?", help="the 1-min load average when it ended (default: unknown)")
    rec.add_argument("--commit", help="the commit the run ran (default: HEAD)")
    go = sub.add_parser("run", help="run `make TARGET`, time it and record it")
    go.add_argument("target", choices=("test", "demo"))
    go.add_argument("--assume-installed", action="store_true", help="never run the install step (make -o)")
    for each in (rec, go):
        each.add_argument("--fresh-clone", action="store_true", help="the run started from a fresh clone")
        each.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            seconds, log = run(args.target, args.fresh_clone, args.assume_installed)
            line = record(args.out, args.target, args.fresh_clone, seconds, log)
        else:
            line = record(args.out, args.target, args.fresh_clone, args.seconds, args.log.read_text(), args.date,
                          args.load, args.commit)
    except RecordError as error:
        print(f"suite_time.py: {error}", file=sys.stderr)
        return 2
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
