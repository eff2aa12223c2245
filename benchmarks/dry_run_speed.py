"""How long `plan --dry-run` takes on the big shipped models (the timings the unit tests used to assert; a unit
test checks what the dry run counts, this file what it costs). One process; the imports and model classes are
warmed first; each case is timed with wall clock and process CPU time.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/dry_run_speed.py --out benchmarks/results/dry_run_speed.md
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from shardscope.plan import dry_run as dr
from shardscope.model.spec import load_model_config

CASES = [("llama-2-70b", "fsdp_tp", 64, 8, 8), ("llama-2-70b", "hsdp_tp", 64, 8, 8)] + [
    (model, "fsdp_full_shard", world, 1, None) for model in ("llama-2-7b", "mistral-7b", "llama-2-70b")
    for world in (8, 64, 512)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the table here (Markdown)")
    args = parser.parse_args()
    configs = {model: load_model_config(model) for model, *_ in CASES}
    dr.dry_run(configs["llama-2-7b"], "fsdp_full_shard", 8)  # warm-up: imports and model classes
    lines = [f"`plan --dry-run` per case, after a warm-up (load average {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} CPU(s))", "", "| model | strategy | ranks | nodes | tp | wall s | CPU s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for model, strategy, world, nodes, tp in CASES:
        wall, cpu = time.perf_counter(), time.process_time()
        result = dr.dry_run(configs[model], strategy, world, nodes=nodes, tp=tp)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert result.computed_matches_built
        lines.append(f"| {model} | {strategy} | {world} | {nodes} | {tp or '-'} | {wall:.2f} | {cpu:.2f} |")
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
