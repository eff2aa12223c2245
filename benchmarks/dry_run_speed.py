"""How long `plan --dry-run` takes on the big shipped models (the timings the unit tests used to assert; a unit
test checks what the dry run counts, this file what it costs). One process; the imports and model classes are
warmed first; each case is timed with wall clock and process CPU time.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/dry_run_speed.py --out benchmarks/results/dry_run_speed.md

`--vs-import N` times instead the whole command for Llama-2-70B on 64 ranks (`shardscope plan --model llama-2-70b
--gpus 8 --nodes 8 --dry-run`, a fresh process; every default strategy, then fsdp_full_shard alone) against
`python -c "import torch, transformers"`, N times each, interleaved (the issue's target: within 1.85x); medians of
wall clock and the child's CPU time (user + sys). The command runs as a user's second run does (the cache holds
the rows of the first, which the benchmark runs before timing) and with the cache off (`SHARDSCOPE_CACHE=off`: every
run builds, as a first run does); beside them, the imports such a build cannot do without (Llama's transformers
config and modeling modules, FSDP2, the fake process group, transformers' TP entry points), and with
`--before PLUGIN_DIR` another checkout's command (e.g. main before a change).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/dry_run_speed.py --vs-import 5 --before /tmp/main/plugin \\
        --out benchmarks/results/dry_run_vs_import.md

`--quick` checks the script works (one small case; with `--vs-import`, Llama-2-7B on 2 ranks): not a result.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_docs.stamped: the measured-at line
from render_docs import stamped  # noqa: E402

from shardscope.plan import dry_run as dr  # noqa: E402
from shardscope.model.spec import load_model_config  # noqa: E402

MEASURES = ("plugin/shardscope/plan", "plugin/shardscope/model", "plugin/shardscope/cli/plan.py")  # render_docs.stale

BUILD_IMPORTS = """import torch, transformers
from transformers.models.llama import configuration_llama, modeling_llama
from transformers.distributed import DistributedConfig
from transformers.distributed.utils import TransformersDeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore
"""
CASES = [("llama-2-70b", "fsdp_tp", 64, 8, 8), ("llama-2-70b", "hsdp_tp", 64, 8, 8)] + [
    (model, "fsdp_full_shard", world, 1, None) for model in ("llama-2-7b", "mistral-7b", "llama-2-70b")
    for world in (8, 64, 512)]
QUICK = [("llama-2-7b", "fsdp_full_shard", 8, 1, None)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the table here (Markdown)")
    parser.add_argument("--vs-import", type=int, metavar="N", help="the whole command against the imports, N times")
    parser.add_argument("--before", help="with --vs-import: another checkout's plugin folder, timed as 'before'")
    parser.add_argument("--quick", action="store_true", help="one small case: checks the script works")
    args = parser.parse_args(argv)
    if args.vs_import:
        return vs_import(args.vs_import, args.out, args.quick, args.before)
    cases = QUICK if args.quick else CASES
    configs = {model: load_model_config(model) for model, *_ in cases}
    dr.dry_run(configs["llama-2-7b"], "fsdp_full_shard", 8)  # warm-up: imports and model classes
    lines = [f"`plan --dry-run` per case, after a warm-up (load average {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} CPU(s))", "", "| model | strategy | ranks | nodes | tp | wall s | CPU s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, strategy, world, nodes, tp in cases:
        wall, cpu = time.perf_counter(), time.process_time()
        result = dr.dry_run(configs[model], strategy, world, nodes=nodes, tp=tp)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert result.computed_matches_built
        lines.append(f"| {model} | {strategy} | {world} | {nodes} | {tp or '-'} | {wall:.2f} | {cpu:.2f} |")
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text(stamped("\n".join(lines) + "\n", __file__, MEASURES))


def vs_import(repeats: int, out: str | None, quick: bool = False, before: str | None = None) -> None:
    import statistics
    import subprocess
    import sys
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from plan_startup import timed

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "plugin"),
           "SHARDSCOPE_CACHE": tempfile.mkdtemp()}
    plan = [sys.executable, "-m", "shardscope", "plan", "--model", "llama-2-70b", "--gpus", "8", "--nodes", "8",
            "--dry-run"]
    off = {**env, "SHARDSCOPE_CACHE": "off"}
    arms = {"import torch, transformers": ([sys.executable, "-c", "import torch, transformers"], env),
            "plan --dry-run 70B, 64 ranks": (plan, env),
            "the same, --strategy fsdp_full_shard": ([*plan, "--strategy", "fsdp_full_shard"], env),
            "plan --dry-run 70B, 64 ranks, cache off": (plan, off),
            "the imports a build needs": ([sys.executable, "-c", BUILD_IMPORTS], env)}
    if before:
        arms["before: plan --dry-run 70B, 64 ranks"] = (plan, {**env, "PYTHONPATH": before})
    if quick:  # two processes: the import and the cheapest dry run
        arms = {"import torch, transformers": arms["import torch, transformers"],
                "plan --dry-run 7B, 2 ranks, --strategy fsdp_full_shard": (
                    [*plan[:5], "llama-2-7b", "--gpus", "2", "--dry-run", "--strategy", "fsdp_full_shard"], env)}
    else:
        for cmd, arm_env in arms.values():
            subprocess.run(cmd, env=arm_env, capture_output=True, check=True)  # page cache; the rows cached
    times = {arm: [] for arm in arms}
    for _ in range(repeats):
        for arm, (cmd, arm_env) in arms.items():
            times[arm].append(timed(cmd, arm_env))
    base = [statistics.median(t[i] for t in times["import torch, transformers"]) for i in (0, 1)]
    lines = [f"`plan --dry-run` against the imports, {repeats} runs each, interleaved, medians (load average "
             f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPU(s); on a machine shared with other jobs CPU s is the "
             f"steadier figure)", "",
             "| command | wall s | CPU s | wall / import | CPU / import |", "| --- | --- | --- | --- | --- |"]
    for arm, runs in times.items():
        wall, cpu = (statistics.median(t[i] for t in runs) for i in (0, 1))
        lines.append(f"| {arm} | {wall:.2f} | {cpu:.2f} | {wall / base[0]:.2f}x | {cpu / base[1]:.2f}x |")
    print("\n".join(lines))
    if out:
        Path(out).write_text(stamped("\n".join(lines) + "\n", __file__, MEASURES))


if __name__ == "__main__":
    main()
