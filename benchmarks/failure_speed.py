"""How long bad input takes to be refused (the timings tests used to assert; each test keeps what it proves, this
file what it costs). Wall clock and CPU time (in-process: `process_time`; a fresh process: the children's user +
sys), one run each:

- a YAML anchor bomb refused by `safe_io.parse_yaml` (tests/test_hostile_input.py: refused unexpanded);
- `plan --dry-run` with a world size that does not fit the mesh, a fresh process (tests/test_dry_run.py: refused
  before torch or transformers is imported);
- the causal-LM recipe given a missing local folder, then a missing hub id with HF_HUB_OFFLINE unset and the
  hub endpoint a closed loopback port (benchmarks send traffic to loopback only) (tests/test_hostile_input.py:
  the hub asked once, a folder never): the difference is what huggingface_hub spends on the one unanswered
  request;
- three bad two-node `accelerate launch`es (tests/test_multinode.py: each fails or is killed, nothing survives):
  main port in use, a main address answering nothing with a 3 s rendezvous timeout, and a node whose main node never
  comes up (killed at the launch helper's 8 s timeout).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/failure_speed.py --out benchmarks/results/failure_speed.md

`--quick` runs the first two cases only (no recipe, no launch): a check that the script works, not a result.
"""
from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the launch helpers the multi-node tests use
sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_docs.stamped: the measured-at line
from render_docs import stamped  # noqa: E402

from launch import accelerate_multinode_launch, cpu_env, free_port  # noqa: E402

from shardscope.configs.catalog import find_config  # noqa: E402
from shardscope.errors import UsageError  # noqa: E402
from shardscope.safe_io import parse_yaml  # noqa: E402

# render_docs.stale: the refusals timed (YAML, the dry run's mesh check, the recipe's model look-up)
MEASURES = ("plugin/shardscope/safe_io.py", "plugin/shardscope/plan/dry_run.py", "plugin/shardscope/cli",
            "plugin/shardscope/recipes", "recipes")

BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"] + [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]"
                                                         for p, n in zip("abcdefgh", "bcdefghi")]) + "\n"


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(action) -> tuple[float, float, object]:
    """(wall s, CPU s of this process and its waited children, result) of `action()`."""
    wall, cpu = time.perf_counter(), time.process_time() + children_cpu()
    result = action()
    return time.perf_counter() - wall, time.process_time() + children_cpu() - cpu, result


def anchor_bomb():
    try:
        parse_yaml(BOMB, "bomb.yaml")
    except UsageError as error:
        return str(error)
    raise AssertionError("the anchor bomb was not refused")


def command(argv: list[str], env: dict):
    def run():
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        return f"exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}"
    return run


def bad_launch(out: Path, **kwargs):
    def run():
        result = accelerate_multinode_launch(find_config("ddp_multinode").path, ROOT / "tests" / "workers" /
                                             "train_tiny.py", ["--help"], out, **kwargs)
        state = "killed at the timeout" if result.timed_out else f"exit {result.returncodes}"
        return f"{state}, {len(result.survivors())} processes left"
    return run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the table here (Markdown)")
    parser.add_argument("--quick", action="store_true", help="the first two cases only (checks the script)")
    args = parser.parse_args(argv)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "plugin")}
    online = {**{k: v for k, v in cpu_env().items() if k != "HF_HUB_OFFLINE"},
              "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}  # a hub that answers nothing, on loopback
    recipe = [sys.executable, str(ROOT / "recipes" / "causal_lm_sft.py"), "--output_dir", tempfile.mkdtemp()]
    tmp = Path(tempfile.mkdtemp(prefix="failure-speed-"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        cases = [
            ("YAML anchor bomb (in-process)", anchor_bomb),
            ("plan --dry-run --world-size 10 --nodes 4 (fresh process)",
             command([sys.executable, "-m", "shardscope", "plan", "--model", "llama-2-7b", "--dry-run",
                      "--world-size", "10", "--nodes", "4"], env)),
            ("recipe, missing local folder", command([*recipe, "--model_name_or_path", "./no/such/folder"], online)),
            ("recipe, missing hub id, HF_HUB_OFFLINE unset, hub endpoint closed",
             command([*recipe, "--model_name_or_path", "shardscope-test/no-such-model"], online)),
            ("2-node launch, main port in use", bad_launch(tmp / "port", main_process_port=busy.getsockname()[1],
                                                           machine_ranks=[0], timeout=30)),
            ("2-node launch, main address answering nothing (a closed loopback port), rendezvous timeout 3 s",
             bad_launch(tmp / "address", main_process_ip="127.0.0.1", main_process_port=free_port(), machine_ranks=[1],
                        launcher_flags=["--rdzv_conf", "timeout=3"], timeout=40)),
            ("2-node launch, no main node, killed at 8 s", bad_launch(tmp / "alone", machine_ranks=[1], timeout=8)),
        ]
        cases = cases[:2] if args.quick else cases
        lines = [f"Bad input, one run each (1-min load average {os.getloadavg()[0]:.1f} at the start, on "
                 f"{os.cpu_count()} CPU(s))", "", "| case | wall s | CPU s | outcome |", "| --- | --- | --- | --- |"]
        for name, action in cases:
            wall, cpu, outcome = timed(action)
            lines.append(f"| {name} | {wall:.3f} | {cpu:.3f} | {str(outcome).replace('|', '/')[:160]} |")
            print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text(stamped("\n".join(lines) + "\n", __file__, MEASURES))


if __name__ == "__main__":
    main()
