"""Start-up of `shardscope plan --model NAME` against `python -c "import torch, transformers"` (issue 15: within
1.5x). Each command runs as a fresh process, the arms interleaved, `--repeats` times; wall clock and the child's
CPU time (user + sys, less disturbed by other jobs on a shared machine) are reported as medians and ratios.

Arms: `import` (the yardstick), `imports a cold plan needs` (the floor of a cold run: the model's transformers
config and modeling modules, torch's FakeTensorMode and MemTracker, and nothing run), `plan cold` (an empty spec
cache: the model is counted on the meta device and its step traced on fake tensors), `plan warm` (the spec cache
holds the model and the traces), and, with `--before PLUGIN_DIR`, `plan before` (another checkout's package,
e.g. main before a change, on an empty cache). `--quick` runs the import and warm arms once: a check that the
script works, not a result.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/plan_startup.py --model llama-2-7b --repeats 5 \\
        --before /tmp/main/plugin --out benchmarks/results/plan_startup.md
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_docs.stamped: the measured-at line
from render_docs import stamped  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MEASURES = ("plugin/shardscope/plan", "plugin/shardscope/model", "plugin/shardscope/cli")  # render_docs.stale
# What a cold `plan --model` imports before it counts anything (argv[1]: the model's config.json).
FLOOR = """import importlib, json, sys
import torch, transformers
from transformers.models.auto.configuration_auto import model_type_to_module_name
name = model_type_to_module_name(json.load(open(sys.argv[1]))["model_type"])
for part in ("configuration", "modeling"):
    importlib.import_module(f"transformers.models.{name}.{part}_{name}")
import torch._subclasses.fake_tensor, torch.distributed._tools.mem_tracker
"""


def timed(cmd: list[str], env: dict) -> tuple[float, float]:
    """(wall seconds, child CPU seconds) of one run of `cmd`, which must succeed."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", help="plugin folder of another checkout, timed as 'plan before'")
    parser.add_argument("--out", help="also write the table here (Markdown)")
    parser.add_argument("--quick", action="store_true", help="the import and warm arms once (checks the script)")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.before = 1, None
    base = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT / "plugin"))
    plan = [sys.executable, "-m", "shardscope", "plan", "--model", args.model, "--gpus", "8", "--gpu", "H100"]
    warm_cache = tempfile.mkdtemp(prefix="plan-startup-warm-")
    subprocess.run(plan, env={**base, "SHARDSCOPE_CACHE": warm_cache}, check=True, stdout=subprocess.DEVNULL)
    sys.path.insert(0, str(ROOT / "plugin"))
    from shardscope.model.spec import resolve_model

    config = str(Path(resolve_model(args.model)) / "config.json")
    arms = {"import torch, transformers": ([sys.executable, "-c", "import torch, transformers"], lambda: base),
            "imports a cold plan needs": ([sys.executable, "-c", FLOOR, config], lambda: base),
            "plan cold (empty cache)": (plan, lambda: {**base, "SHARDSCOPE_CACHE": tempfile.mkdtemp()}),
            "plan warm (cached spec)": (plan, lambda: {**base, "SHARDSCOPE_CACHE": warm_cache})}
    if args.quick:
        arms = {name: arm for name, arm in arms.items() if not name.startswith(("imports", "plan cold"))}
    if args.before:
        arms["plan before (empty cache)"] = (plan, lambda: {**base, "PYTHONPATH": args.before,
                                                            "SHARDSCOPE_CACHE": tempfile.mkdtemp()})
    load_before = os.getloadavg()[0]
    runs = {name: [] for name in arms}
    for _ in range(args.repeats):
        for name, (cmd, env) in arms.items():
            runs[name].append(timed(cmd, env()))
    medians = {name: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r))
               for name, r in runs.items()}
    wall0, cpu0 = medians["import torch, transformers"]
    lines = [f"`shardscope plan --model {args.model}` start-up, {args.repeats} interleaved runs each, medians "
             f"(1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on "
             f"{os.cpu_count()} CPU(s))", "",
             "| command | wall s | CPU s | wall / import | CPU / import |", "| --- | --- | --- | --- | --- |"]
    for name, (wall, cpu) in medians.items():
        lines.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {wall / wall0:.2f} | {cpu / cpu0:.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(stamped(text + "\n", __file__, MEASURES))


if __name__ == "__main__":
    main()
