"""How long `plan` takes in-process on the big shipped models (the timing tests/test_planner.py used to assert
for Llama-2-70B; the test keeps what it proves: the exact count, and no memory for the parameters). One process,
the libraries loaded first; each model is counted on the meta device with the spec cache off (`model_spec`) and
planned for every strategy (`estimate`, formula activations: no step trace), timed with wall clock and CPU time.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/plan_speed.py --out benchmarks/results/plan_speed.md
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # render_docs.stamped: the measured-at line
from render_docs import stamped  # noqa: E402
from shardscope.plan.mesh import Setup  # noqa: E402
from shardscope.model.spec import model_spec  # noqa: E402
from shardscope.plan.planner import estimate  # noqa: E402

MEASURES = ("plugin/shardscope/plan", "plugin/shardscope/model")  # render_docs.stale

MODELS = ("llama-2-7b", "llama-2-70b", "mixtral-8x7b", "qwen2.5-72b", "llama-3.1-405b")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the table here (Markdown)")
    parser.add_argument("--models", nargs="+", default=MODELS, help="shipped model names (default: the big ones)")
    args = parser.parse_args(argv)
    os.environ["SHARDSCOPE_CACHE"] = "off"  # count every model, as a first plan does
    setup = Setup(gpus_per_node=8, nodes=4, gpu_memory_bytes=80 * 2 ** 30, activation_checkpointing=True)
    estimate(model_spec("llama-2-7b"), setup)  # warm-up: imports and model classes
    lines = [f"`model_spec` (cache off) + `estimate`, 8 x 4 GPUs of 80 GiB, after a warm-up (1-min load average "
             f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPU(s))", "",
             "| model | parameters | spec wall s | spec CPU s | estimate wall s | estimate CPU s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for model in args.models:
        wall, cpu = time.perf_counter(), time.process_time()
        spec = model_spec(model)
        spec_wall, spec_cpu = time.perf_counter() - wall, time.process_time() - cpu
        wall, cpu = time.perf_counter(), time.process_time()
        estimate(spec, setup)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        lines.append(f"| {model} | {spec.params_total:,} | {spec_wall:.2f} | {spec_cpu:.2f} | {wall:.3f} | "
                     f"{cpu:.3f} |")
        print(lines[-1], flush=True)
    if args.out:
        Path(args.out).write_text(stamped("\n".join(lines) + "\n", __file__, MEASURES))


if __name__ == "__main__":
    main()
