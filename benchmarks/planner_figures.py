"""The planner's figures that docs/planner.md quotes, from the `shardscope plan --json` commands that give them.

Deterministic (the planner is computed, not timed) and fast: two plans, in one process. The results file holds
the commands, the figures as parts that benchmarks/render_docs.py places into the docs, and the rows they come
from; tests/test_benchmarks.py writes it again and compares.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/planner_figures.py --out benchmarks/results/planner_figures.md
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "planner_figures.md"
# name -> the plan's arguments (bf16-mixed, AdamW, micro-batch 1: the planner's defaults)
PLANS = {"7b": ["--model", "llama-2-7b", "--seq-len", "4096", "--gpus", "8"],
         "70b": ["--model", "llama-2-70b", "--gpus", "8", "--nodes", "2"]}


def plan(argv: list[str]) -> dict:
    from shardscope.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["plan", *argv, "--json"])
    if code not in (0, 1):  # 1: nothing fits, still a plan
        raise SystemExit(f"shardscope plan {' '.join(argv)} exited {code}")
    return json.loads(out.getvalue())


def gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def figures(plans: dict) -> dict[str, str]:
    """The figures the docs quote, by part name."""
    rows = {name: {r["strategy"]: r for r in p["rows"]} for name, p in plans.items()}
    seven, seventy = rows["7b"], rows["70b"]
    return {
        "act7b-sharded": gb(seven["fsdp_full_shard"]["activations_bytes"]),
        "act7b-ddp": gb(seven["ddp"]["activations_bytes"]),
        "act7b-formula": gb(plans["7b"]["activations"]["total"]),
        "act70b-tp": f"{gb(plans['70b']['activations']['total'])} to "
                     f"{gb(plans['70b']['tp']['activations']['total'])}",
        "comm70b": f"{seventy['fsdp_full_shard']['comm_bytes_per_step'] / 1e9:.0f} GB vs "
                   f"{seventy['fsdp_tp']['comm_bytes_per_step'] / 1e9:.0f} GB",
    }


def markdown(plans: dict) -> str:
    lines = ["# Planner figures quoted in docs/planner.md", "",
             "Written by `benchmarks/planner_figures.py` from `shardscope plan` (computed, not measured; GB = 1e9 B).",
             ""]
    lines += [f"- `{name}`: `shardscope plan {' '.join(argv)} --json`" for name, argv in PLANS.items()]
    lines += ["", "| plan | strategy | activations at the peak | activations source | peak | comm/step |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, p in plans.items():
        for r in p["rows"]:
            lines.append(f"| {name} | {r['strategy']} | {gb(r['activations_bytes'])} | "
                         f"{r.get('activations_source', '-')} | {gb(r['total_bytes'])} | "
                         f"{gb(r['comm_bytes_per_step'])} |")
    lines += ["", "Figures (the written-out activation formula is the plan's `activations.total`; TP degree "
              f"{plans['70b']['tp']['degree']} for the 70B's `tp.activations.total`):", ""]
    for part, value in figures(plans).items():
        lines += [f"<!-- part:{part} -->", value, f"<!-- /part:{part} -->"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "plugin"))
    from shardscope.safe_io import atomic_write_text

    text = markdown({name: plan(argv) for name, argv in PLANS.items()})
    atomic_write_text(args.out, text, "results")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
