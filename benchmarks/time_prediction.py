"""Predicted beside measured step time on 2 CPU ranks: the step-time model calibrated from one run.

    python benchmarks/time_prediction.py [RUNS_DIR]   # -> benchmarks/results/time_prediction.md

Without RUNS_DIR it trains them first (tests/workers/train_time.py under torchrun: DDP, ZeRO-1/2/3 through the
Trainer's DeepSpeed integration, FSDP2 full shard and shard-grad-op through tests/cpu_shim), each strategy's
configurations (accumulation 1 and 2, checkpointing off and on) one after another in one launched process,
8 steps each (instrumented steps 1-3, plain steps 4-8). Then: calibrated from the DDP run at accumulation 1
without checkpointing, every run's prediction beside its measured median; and DDP predicted from ZeRO-3.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugin"))

STRATEGIES = {"ddp": [], "zero1": ["--deepspeed_stage", "1"], "zero2": ["--deepspeed_stage", "2"],
              "zero3": ["--deepspeed_stage", "3"], "fsdp_full_shard": ["--fsdp", "full_shard"],
              "fsdp_shard_grad_op": ["--fsdp", "shard_grad_op"]}
CONFIGS = ("a1c0", "a2c0", "a1c1", "a2c1")  # accumulation x checkpointing
TOLERANCE = 0.15  # the bar for a prediction against a measured median
MODEL = dict(vocab_size=408, hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
             num_key_value_heads=6)  # benchmarks/strategies_cpu.sh's model: a step is compute, not launch overhead


def train_all(root: Path) -> None:
    from shardscope.recipes.tiny import make_causal_lm

    make_causal_lm(root / "model", "llama", **MODEL)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "cpu_shim"), str(ROOT / "plugin")]))
    for port, (name, extra) in enumerate(STRATEGIES.items(), start=29731):
        cmd = ["torchrun", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(ROOT / "tests" / "workers" / "train_time.py"), "--model", str(root / "model"),
               "--configs", ",".join(CONFIGS), *extra, "--output_dir", str(root / name)]
        subprocess.run(cmd, env=env, check=True, cwd=ROOT, capture_output=True)


def predictions(root: Path, calibrate_from: str) -> list[dict]:
    from shardscope.plan.calibration import calibrate, run_figures
    from shardscope.plan.time_model import hardware
    from shardscope.plan.time_model import datasheet_figures
    from shardscope.report.time_prediction import explaining_part, predict_run

    fig, _ = calibrate([(str(root / calibrate_from), run_figures(root / calibrate_from))], datasheet_figures(hardware("H100", "fp32")))
    out = []
    for name in STRATEGIES:
        for config in CONFIGS:
            run = root / name / config
            if (run / "shardscope_summary.json").is_file():
                p = predict_run(run, fig)
                out.append({**p, "name": f"{name}/{config}", "explains": explaining_part(p)})
    return out


def compute_per_pass(r: dict) -> float:
    """Measured compute seconds per forward + backward of one micro-batch (a checkpointed one counts 4/3): the
    same FLOPs in every run, so its spread is what no single compute rate can predict."""
    return r["measured_parts"]["compute"] / (r["accumulation"] * (4 / 3 if r["checkpointing"] else 1))


def table(rows: list[dict]) -> list[str]:
    lines = ["| run | accumulation | checkpointing | predicted (s) | measured median (s) | p10-p90 (s) | error | "
             "largest part difference | measured compute per pass (s) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["measured"]
        flag = "" if abs(r["error"]) <= TOLERANCE else " **over 15%**"
        lines.append(f"| {r['name']} | {r['accumulation']} | {'on' if r['checkpointing'] else 'off'} | "
                     f"{r['predicted_s']:.3f} | {m['median']:.3f} | {m['p10']:.3f}-{m['p90']:.3f} | "
                     f"{r['error']:+.1%}{flag} | {r['explains'] or '-'} | {compute_per_pass(r):.3f} |")
    return lines


def section(root: Path) -> list[str]:
    from_ddp, from_zero3 = predictions(root, "ddp/a1c0"), predictions(root, "zero3/a1c0")
    within = sum(abs(r["error"]) <= TOLERANCE for r in from_ddp)
    passes = [compute_per_pass(r) for r in from_ddp]
    return [f"## Runs in {root.name}: calibrated from ddp/a1c0 (DDP, accumulation 1, checkpointing off), {within} of "
            f"{len(from_ddp)} within {TOLERANCE:.0%}", "", *table(from_ddp), "",
            f"Measured compute per forward + backward pass of the same micro-batch (same FLOPs in every run): "
            f"{min(passes):.3f} to {max(passes):.3f} s, a {max(passes) / min(passes):.2f}x spread between runs; the "
            "model has one achieved FLOP/s, so the compute part alone is off by up to that spread. Part of it is the "
            "load other jobs put on the 2 cores (it moves within one launch, same strategy, configurations back to "
            "back), part the strategy's own CPU work inside forward and backward (DeepSpeed's gradient hooks and "
            "bucket copies, FSDP2's copy-in/out), which the model does not separate from compute.", "",
            f"### Runs in {root.name}: DDP calibrated from zero3/a1c0", "",
            *table([r for r in from_zero3 if r["strategy"] == "ddp"]), ""]


def main() -> None:
    roots = [Path(a) for a in sys.argv[1:]]
    if not roots:
        roots = [Path(os.environ.get("TMPDIR", "/tmp")) / "time_prediction"]
        train_all(roots[0])
    text = ["# Step time predicted beside measured (2 CPU ranks, gloo)", "",
            "Generated by `benchmarks/time_prediction.py [RUNS_DIR ...]` (this file is its output; each folder of "
            "runs is one section, every launch of it trained on a machine other jobs shared). Model: random Llama, "
            "hidden 384, 4 layers, vocab 408 (7.4M parameters), fp32, micro-batch 2 x 128 tokens per rank; 8 "
            "optimizer steps per run, profiler instruments at steps 1-3, medians over the plain steps. The largest "
            "part difference is the part (compute, exposed_comm, optimizer, overhead) whose prediction is furthest "
            "from the timed step's breakdown scaled to the median (signed: + predicted more).", ""]
    for root in roots:
        text += section(root)
    out = ROOT / "benchmarks" / "results" / "time_prediction.md"
    out.write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
